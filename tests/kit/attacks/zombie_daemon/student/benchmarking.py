"""Leaves a daemon the /proc sweeps used to miss: double-forked, out of the session, with an empty environment (no
grading marker), and whose main thread left with the raw ``exit`` syscall while another thread runs on — /proc
shows such a process as a zombie (``Z``), and it is alive."""

import os
import sys

DAEMON = """# 7654321
import ctypes, platform, threading, time
threading.Thread(target=time.sleep, args=(7654321,)).start()
time.sleep(0.2)
ctypes.CDLL(None).syscall({"x86_64": 60, "aarch64": 93}[platform.machine()], 0)  # SYS_exit: this thread only
"""


def _daemon() -> None:
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.execve(sys.executable, [sys.executable, "-c", DAEMON], {})
        os._exit(0)


def time_fn(fn, *, warmup, iters, sync=None, clock=None):
    _daemon()
    raise NotImplementedError("time_fn")


def annotated_scaled_dot_product_attention(q, k, v, is_causal=False):
    raise NotImplementedError("annotated_scaled_dot_product_attention")


def benchmark_model(*args, **kwargs):
    raise NotImplementedError("benchmark_model")


def profile_step(*args, **kwargs):
    raise NotImplementedError("profile_step")

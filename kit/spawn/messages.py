"""What a failed run says: the failing rank's own message first, then where to look."""

from __future__ import annotations

import signal

from .parent import Ranks

__tracebackhide__ = True  # pytest: the kit's plumbing is not part of a student's traceback


def _exit_status(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def silent_death(ranks: Ranks, rank: int) -> dict[str, str]:
    """A report for a rank that died without one, built from the last lines it wrote to stderr."""
    tail = ranks.stderr_tail(rank)
    # gloo's abort explains itself in a `what():` line ("... Is there a distributed collective mismatch?").
    said = next((line.split("what():", 1)[1].strip() for line in reversed(tail) if "what():" in line), "")
    message = f"{_exit_status(ranks.procs[rank].exitcode)} without reporting" + (f": {said}" if said else "")
    if tail:
        message += "\nIts last lines on stderr:\n" + "\n".join(f"  {line}" for line in tail)
    return {"type": "RankDied", "message": message, "traceback": ""}


def failure_message(world_size: int, errors: dict[int, dict[str, str]]) -> str:
    """The first error's own message first (it survives pytest's one-line summary), then its traceback."""
    first, report = next(iter(errors.items()))
    others = [r for r in errors if r != first]
    headline, _, rest = (report["message"] or "(no message)").partition("\n")
    kind = "" if report["type"] == "RankDied" else f"failed: {report['type']}: "
    text = f"rank {first} of {world_size} {kind}{headline}"
    if rest:
        text += "\n" + rest
    if others:
        text += f"\n(then ranks {others} failed too, most likely as a consequence)"
    if report["traceback"]:
        text += f"\nTraceback of rank {first} (most recent call last):\n{report['traceback'].rstrip()}"
    return text


def _innermost_own_frame(stack: str) -> str:
    """The innermost frame of the stack that is neither the standard library, torch nor the kit."""
    frames = [line.strip().removeprefix("File ").replace('"', "") for line in stack.splitlines()
              if line.strip().startswith("File ")]
    library = ("site-packages", "/lib/python", "<frozen", "<string>", "kit/spawn/")
    own = [f for f in frames if not any(s in f for s in library)]
    if own:
        return own[0]
    return f"{frames[0].rsplit(' in ', 1)[-1]}, before any code of its own" if frames else "(not started yet)"


def timeout_message(world_size: int, timeout: float, stacks: dict[int, str]) -> str:
    where = "; ".join(f"rank {r} at {_innermost_own_frame(s)}" for r, s in stacks.items())
    text = (f"ranks {list(stacks)} of {world_size} did not finish within {timeout:g} s: {where}. A collective "
            "that not every rank joined (or joined with another size) waits forever; or the timeout is too "
            "small. Stacks, innermost call first:")
    for r, stack in stacks.items():
        lines = [line for line in stack.splitlines() if "<frozen importlib" not in line]
        text += f"\n--- rank {r} ---\n" + ("\n".join(lines) or "(no stack: the rank had not started)")
    return text

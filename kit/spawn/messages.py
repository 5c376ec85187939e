"""What a failed run says: the failing rank's own message first, then where to look."""

from __future__ import annotations

import signal

from .parent import Outcome

__tracebackhide__ = True  # pytest: the kit's plumbing is not part of a student's traceback


def silent_death(outcome: Outcome, rank: int) -> dict[str, str]:
    """A report for a rank that died without one, built from the last lines it wrote to stderr."""
    tail = outcome.stderr.get(rank, [])
    # gloo's abort explains itself in a `what():` line ("... Is there a distributed collective mismatch?").
    said = next((line.split("what():", 1)[1].strip() for line in reversed(tail) if "what():" in line), "")
    message = f"{describe_exit(outcome.died.get(rank))} without reporting" + (f": {said}" if said else "")
    if tail:
        message += "\nIts last lines on stderr:\n" + "\n".join(f"  {line}" for line in tail)
    return {"type": "RankDied", "kind": "error", "message": message, "traceback": ""}


def errors_of(outcome: Outcome) -> dict[int, dict[str, str]]:
    """The failure report of each rank that failed or died, the cause first: a rank that died without a word
    caused whatever its peers then reported."""
    errors = {r: silent_death(outcome, r) for r in outcome.died}
    for r in outcome.errors_first:
        failure = outcome.finals[r].get("failure")
        errors[r] = failure if isinstance(failure, dict) else {"type": "Error", "kind": "error", "traceback": "",
                                                                "message": "(a failure without a description)"}
    return errors


def failure_message(world_size: int, errors: dict[int, dict[str, str]]) -> str:
    """The first error's own message first (it survives pytest's one-line summary), then its traceback."""
    first, report = next(iter(errors.items()))
    others = [r for r in errors if r != first]
    headline, _, rest = (str(report.get("message") or "(no message)")).partition("\n")
    kind = "" if report.get("type") == "RankDied" else f"failed: {report.get('type')}: "
    text = f"rank {first} of {world_size} {kind}{headline}"
    if rest:
        text += "\n" + rest
    if others:
        text += f"\n(then ranks {others} failed too, most likely as a consequence)"
    if report.get("traceback"):
        text += f"\nTraceback of rank {first} (most recent call last):\n{str(report['traceback']).rstrip()}"
    return text


def innermost_own_frame(stack: str) -> str:
    """The innermost frame of the stack that is neither the standard library, torch nor the kit."""
    frames = [line.strip().removeprefix("File ").replace('"', "") for line in stack.splitlines()
              if line.strip().startswith("File ")]
    library = ("site-packages", "/lib/python", "<frozen", "<string>", "kit/spawn/")
    own = [f for f in frames if not any(s in f for s in library)]
    if own:
        return own[0]
    return f"{frames[0].rsplit(' in ', 1)[-1]}, before any code of its own" if frames else "(no stack)"


def limit_message(outcome: Outcome, what: str, timeout: float) -> str:
    """Why a request was stopped, where each process was, and what to look for."""
    spent, cpu_budget, idle = outcome.limits
    where = "; ".join(f"{'process' if outcome.n == 1 else 'rank'} {r} at {innermost_own_frame(s)}"
                      for r, s in outcome.stacks.items())
    if outcome.limit == "cpu":
        why = (f"used {spent:.1f} CPU-seconds, more than its budget of {cpu_budget:.1f} (several times what "
               "the reference needs): an endless loop, or work far beyond what the test asks")
    elif outcome.limit == "idle":
        why = (f"made no progress for {idle:g} s (almost no CPU used, nothing waiting for a core) without "
               "finishing: it is blocked — a collective that not every rank joined (or joined with another size), a "
               "wait on something that never comes, a sleep")
    else:
        why = (f"did not finish within {timeout:g} s of wall-clock time although it kept working (the last resort, "
               "far above a busy machine's needs)")
    text = f"{what} {why}. Stopped at: {where or '(unknown)'}. Stacks, innermost call first:"
    for r, stack in outcome.stacks.items():
        lines = [line for line in stack.splitlines() if "<frozen importlib" not in line]
        label = "process" if outcome.n == 1 else "rank"
        text += f"\n--- {label} {r} ---\n" + ("\n".join(lines) or "(no stack: it had not started, or it blocks the "
                                                              "signal that asks for one)")
    return text


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exited"
    if code > 128:
        try:
            return f"was killed by {signal.Signals(code - 128).name}"
        except ValueError:
            return f"was killed by signal {code - 128}"
    return f"exited with code {code}"

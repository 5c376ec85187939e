"""What a failed run says: the failing rank's own message first, then where to look."""

from __future__ import annotations

from .parent import Outcome, describe_exit

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

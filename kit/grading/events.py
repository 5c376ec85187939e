"""The child's grading log: signed JSON lines, read as they are written, folded into what the run did.

:mod:`kit.grading.plugin` (the judge) appends one line per event, each with a sequence number and an HMAC under a
key only the grader knows. Events, in the order a run writes them:

* ``collected`` — every graded test (``nodeid``, ``stage``, ``points``, ``hidden``, ``doc``);
* ``import`` / ``imported`` — a stage's implementation module is being imported / has imported or failed;
* ``start`` — a test begins, with ``limit``: the seconds it may take (setup, call and teardown);
* ``report`` — one phase's result (``when``: setup, call or teardown; ``outcome``, ``longrepr``, ``duration``);
* ``flag`` — something a submission did that grading does not allow;
* ``finished`` — the session ended normally.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from pathlib import Path


def signer(key: bytes):
    """HMAC-SHA256 over the event's canonical JSON; an empty key signs nothing (local runs)."""
    def sign(event: dict) -> str:
        body = json.dumps(event, sort_keys=True).encode()
        return hmac.new(key, body, hashlib.sha256).hexdigest() if key else ""
    return sign


class SignedLog:
    """Reads a log as it grows, keeping the events whose sequence number and HMAC check out."""

    def __init__(self, path: Path, key: str):
        self.path = path
        self.sign = signer(key.encode())
        self.offset = 0
        self.forged = 0
        self.seq = 0

    def read_new(self) -> list[dict]:
        """The complete lines written since the last call, verified (a half-written last line waits)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        events = []
        for line in data[:end].decode("utf-8", "replace").splitlines():
            try:
                event = json.loads(line)
                mac = event.pop("mac")
            except (ValueError, KeyError, AttributeError, TypeError):
                self.forged += 1
                continue
            if event.get("seq") != self.seq or not hmac.compare_digest(str(mac), self.sign(event)):
                self.forged += 1
                continue
            events.append(event)
            self.seq += 1
        return events


@dataclass
class Activity:
    """What the child is doing now — importing a module or running a test — and until when it may."""

    kind: str  # "import" | "test"
    what: str  # module name or test nodeid
    stage: int
    limit: float
    since: float = field(default_factory=time.monotonic)

    def overdue(self, grace: float) -> bool:
        return time.monotonic() > self.since + self.limit + grace


@dataclass
class RunRecord:
    """Everything the child processes of one run reported, over all their attempts."""

    collected: list[dict] | None = None
    reports: dict[str, dict[str, dict]] = field(default_factory=dict)  # nodeid → when → report
    import_failures: dict[str, str] = field(default_factory=dict)  # module → why it did not import
    flags: list[str] = field(default_factory=list)
    activity: Activity | None = None
    finished: bool = False  # of the current attempt
    leftovers: int = 0  # processes the workers left running, killed by the judge (all attempts)

    def apply(self, event: dict) -> None:
        kind = event["event"]
        if kind == "collected" and self.collected is None:
            self.collected = event["tests"]
        elif kind == "import":
            self.activity = Activity("import", event["module"], event["stage"], event["limit"])
        elif kind == "imported":
            self.activity = None
            if event["outcome"] != "passed":
                self.import_failures.setdefault(event["module"], event["message"])
        elif kind == "start":  # limit 0: the test has no time limit
            self.activity = Activity("test", event["nodeid"], 0, event["limit"] or float("inf"))
        elif kind == "report":
            self.reports.setdefault(event["nodeid"], {})[event["when"]] = event
            if event["when"] == "teardown":
                self.activity = None
        elif kind == "flag":
            self.flags.append(f"{event['nodeid'].split('::')[-1] or 'collection'}: {event['what']}")
        elif kind == "finished":
            self.finished = True
            self.activity = None
            leftovers = event.get("leftovers", 0)
            self.leftovers += leftovers if isinstance(leftovers, int) and not isinstance(leftovers, bool) else 0

    def unreported(self) -> list[str]:
        """Collected tests that have not finished (no teardown report), in collection order."""
        return [t["nodeid"] for t in self.collected or [] if "teardown" not in self.reports.get(t["nodeid"], {})]

    def fail(self, nodeid: str, message: str) -> None:
        """Record a test the child could not report itself (it died or hung in it) as failed."""
        phases = self.reports.setdefault(nodeid, {})
        phases["call"] = {"outcome": "failed", "when": "call", "longrepr": message, "duration": 0.0}
        phases["teardown"] = {"outcome": "passed", "when": "teardown", "longrepr": "", "duration": 0.0}

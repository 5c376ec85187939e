"""``make test-clean-machine``: the kit's set-up, then the README's two commands, on a clean Debian, timed.

What a student with a fresh Linux machine does, run here without a container engine (this workplace refuses
``podman run``): ``mmdebstrap`` builds a minimal Debian root file system from Debian's packages alone
(:data:`PACKAGES`: Python, venv, make, git, certificates; no compiler, no pip of the system's), a clean copy of this
checkout goes in, and each step runs there as root under ``unshare`` (its own mount and PID namespaces: a fresh
/proc and /dev/shm, every process ended with the step) and ``chroot``, timed on the wall clock::

    python -m instructor clean-machine                    # bookworm (Python 3.11): make setup, make grade, make test
    python -m instructor clean-machine --quick            # … the README's commands with STAGE=1 (minutes, not 20+)
    python -m instructor clean-machine --suite bullseye   # Python 3.9: every step must stop, saying what to install
    python -m instructor clean-machine --dry-run          # the plan only: packages, bound paths, steps

The steps are the set-up script (``make setup``: kit/setup/bootstrap.py, the one the dev container's Dockerfile runs
too) and then the commands of the README's "Quick start", read from README.md (:func:`readme_commands`), so the test
follows the README. pip inside reaches the package sources this machine's pip uses and nothing more: its
configuration files, its PIP_* variables and the local folders and file:// indexes they name are bound read-only at
the same paths (:func:`pip_sources`), so the times measure the kit's set-up, not another network. The root shares
this machine's network and host name: /etc/resolv.conf and /etc/hosts are copied in. The table goes to
benchmarks/results/clean-machine-<suite>[-quick].md (``--out DIR`` elsewhere). Needs root and mmdebstrap (installed
with apt-get when missing); the root file system (~450 MiB, ~2 GiB after the set-up) is deleted afterwards
unless ``--keep``.
"""

from __future__ import annotations

import argparse
import configparser
import datetime
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kit.setup import python_check

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# Debian's packages only: what the README's Quick start asks of a machine ("Python >= 3.11 and make") plus what a
# student's clone has anyway (git; the certificates pip needs for an https index).
PACKAGES = ("python3", "python3-venv", "make", "git", "ca-certificates")
SUITES = {
    "bookworm": "Debian 12, Python 3.11: the set-up and the README's commands must pass",
    "bullseye": "Debian 11, Python 3.9: every step must stop with a message that says what to install",
}
# Suites whose python3 is older than the kit's minimum: there, passing means stopping clearly.
TOO_OLD = {"bullseye"}
TOO_OLD_MARK = f"the kit needs Python {'.'.join(map(str, python_check.MINIMUM))} or newer"
SETUP = "make setup"
GUEST = "/root/llmsys"
GUEST_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
             "LANG": "C.UTF-8", "TERM": "dumb"}
# Not package sources but this machine's CPU quirks (older OpenBLAS builds misbehave on some processors): passed on
# when set, so that the root computes as this machine does.
PASSED_ON = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def readme_commands(readme: Path = ROOT / "README.md") -> list[str]:
    """The commands of the README's "Quick start": its first bash block, comments dropped."""
    match = re.search(r"^## Quick start\n.*?^```bash\n(.*?)^```", readme.read_text(), re.S | re.M)
    if match is None:
        raise ValueError(f"{readme} has no ```bash block under '## Quick start'")
    return [line for line in (raw.split("#", 1)[0].strip() for raw in match.group(1).splitlines()) if line]


def steps(stage: str | None = None, readme: Path = ROOT / "README.md") -> list[tuple[str, str]]:
    """``(what, command)`` in order: the set-up script, then each README command (``STAGE=stage`` appended)."""
    extra = f" STAGE={stage}" if stage else ""
    return [("set-up", SETUP)] + [(f"README: {cmd}", cmd + extra) for cmd in readme_commands(readme)]


def pip_config_files(env: dict[str, str] = os.environ, home: Path | None = None) -> list[Path]:
    """pip's configuration files that exist here (global, XDG, user, ``PIP_CONFIG_FILE``)."""
    home = Path.home() if home is None else home
    candidates = [Path("/etc/pip.conf")]
    candidates += [Path(d) / "pip" / "pip.conf" for d in env.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":") if d]
    candidates += [home / ".config" / "pip" / "pip.conf", home / ".pip" / "pip.conf"]
    if env.get("PIP_CONFIG_FILE"):
        candidates.append(Path(env["PIP_CONFIG_FILE"]))
    return [p for p in dict.fromkeys(candidates) if p.is_file()]


def local_paths(values: list[str], exists=os.path.exists) -> list[Path]:
    """The absolute local paths that pip setting values name and that exist here: a plain path (a wheel folder, a
    constraints file) as it is; a ``file://`` index (``…/simple``) with the folder above it, where a local index keeps
    the files its pages link to (``../../files/…``)."""
    found = []
    for value in values:
        for token in value.split():
            url = token.startswith("file://")
            path = token.removeprefix("file://").rstrip("/") or "/"
            if path.startswith("/") and exists(path):
                found.append(Path(path).parent if url and path != "/" else Path(path))
    return found


def outermost(paths: list[Path]) -> list[Path]:
    """``paths`` without duplicates and without those inside another one (binding the outer one covers them)."""
    unique = sorted(set(paths), key=lambda p: (len(p.parts), str(p)))
    kept: list[Path] = []
    for p in unique:
        if not any(p == k or k in p.parents for k in kept):
            kept.append(p)
    return kept


@dataclass
class PipSources:
    """What the root needs to install as this machine does: paths bound read-only, PIP_* variables passed."""

    files: list[Path] = field(default_factory=list)
    binds: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


def pip_sources(env: dict[str, str] = os.environ, home: Path | None = None) -> PipSources:
    """This machine's pip configuration: its files, the local paths their settings and PIP_* name, the PIP_* vars."""
    files = pip_config_files(env, home)
    values: list[str] = []
    for path in files:
        parser = configparser.RawConfigParser()
        parser.read(path)
        for section in parser.sections():
            values += [v for v in parser[section].values() if v]
    pip_env = {k: v for k, v in env.items() if k.startswith("PIP_")}
    values += list(pip_env.values())
    return PipSources(files, outermost(files + local_paths(values)), pip_env)


def guest_env(sources: PipSources, env: dict[str, str] = os.environ) -> dict[str, str]:
    return {**GUEST_ENV, **sources.env, **{k: env[k] for k in PASSED_ON if k in env}}


def copy_checkout(dest: Path, source: str) -> str:
    """A clean checkout in ``dest``: ``head`` (git archive HEAD) or ``worktree`` (the files git would commit, as
    they are now: tracked and not ignored, no .venv, no build outputs), committed there as one commit so that the
    kit's git-reading tools (the release's file list) see a checkout. Returns a description of the source."""
    dest.mkdir(parents=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    if source == "head":
        archive = subprocess.run(["git", "archive", "--format=tar", "HEAD"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
        described = f"git archive {head}"
    else:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout
        for name in sorted({n for n in listed.split("\0") if n}):
            src = ROOT / name
            if src.is_dir() or not (src.exists() or src.is_symlink()):  # a submodule; deleted in the working tree
                continue
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        described = f"working tree of {head}" + (" with uncommitted changes" if dirty.strip() else "")
    git = ["git", "-C", str(dest), "-c", "user.name=clean-machine", "-c", "user.email=clean-machine@localhost"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "clean checkout"]):
        subprocess.run(git + args, check=True, capture_output=True)
    return described


def prepare_binds(root: Path, binds: list[Path]) -> None:
    """Mount points inside ``root`` for each bound path (an empty folder or file), and this machine's resolver."""
    for path in binds:
        target = root / path.relative_to("/")
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(exist_ok=True)
    for name in ("etc/resolv.conf", "etc/hosts"):
        if (Path("/") / name).is_file():
            (root / name).unlink(missing_ok=True)
            shutil.copyfile(Path("/") / name, root / name)


def chroot_command(root: Path, command: str, binds: list[Path], env: dict[str, str], cwd: str = GUEST) -> list[str]:
    """``command`` run in ``root`` as root: new mount and PID namespaces (mounts and processes end with it), a fresh
    /proc and /dev/shm, this machine's /dev and /sys, ``binds`` read-only at their own paths, only ``env``."""
    r = shlex.quote(str(root))
    mounts = [f"mount -t proc proc {r}/proc", f"mount --rbind /dev {r}/dev",
              f"mount -t tmpfs -o mode=1777 tmpfs {r}/dev/shm", f"mount --rbind /sys {r}/sys"]
    for path in binds:
        src, dst = shlex.quote(str(path)), shlex.quote(str(root / path.relative_to("/")))
        mounts.append(f"mount --bind {src} {dst} && mount -o remount,bind,ro {dst}")
    inner = f"cd {shlex.quote(cwd)} && {command}"
    variables = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    script = " && ".join(mounts) + f" && exec chroot {r} /usr/bin/env -i {variables} /bin/bash -c {shlex.quote(inner)}"
    return ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private", "--",
            "/bin/sh", "-c", script]


@dataclass
class Step:
    what: str
    command: str
    status: int | None = None  # None: not run
    seconds: float = 0.0
    tail: list[str] = field(default_factory=list)


def run_step(step: Step, root: Path, binds: list[Path], env: dict[str, str], log, timeout: float) -> Step:
    """Run ``step`` in ``root``, its output streamed to stdout and ``log``; fills status, seconds and tail."""
    banner = f"== [{step.what}] {step.command}"
    print(banner, flush=True)
    log.write(banner + "\n")
    start = time.monotonic()
    proc = subprocess.Popen(chroot_command(root, step.command, binds, env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    # unshare --kill-child: killing it ends the step's PID namespace, so every process of the step.
    watchdog = threading.Timer(timeout, proc.kill)
    watchdog.start()
    tail: list[str] = []
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            tail = (tail + [line.rstrip("\n")])[-60:]
    finally:
        watchdog.cancel()
        proc.stdout.close()
        step.status = proc.wait()
    if time.monotonic() - start >= timeout:
        tail.append(f"(stopped after {timeout:.0f} s)")
    step.seconds = time.monotonic() - start
    step.tail = tail
    sys.stdout.flush()
    return step


def stopped_clearly(step: Step) -> bool:
    """On a too-old Python: the step failed, with the message that says what to install and no traceback."""
    text = "\n".join(step.tail)
    return step.status not in (0, None) and TOO_OLD_MARK in text and "Traceback" not in text


def verdict(suite: str, done: list[Step]) -> tuple[bool, str]:
    if suite in TOO_OLD:
        ok = bool(done) and all(stopped_clearly(s) for s in done)
        return ok, ("every step stopped with the message that says what to install" if ok
                    else "a step did not stop with the message that says what to install (or printed a traceback)")
    ok = bool(done) and all(s.status == 0 for s in done)
    return ok, "every step passed" if ok else "a step failed"


def machine() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, load {load:.1f})"


def report(suite: str, stage: str | None, described: str, inside: str, sources: PipSources, build_s: float,
           done: list[Step], ok: bool, why: str, started: str, load_before: str) -> str:
    mode = f"quick: the README's commands with STAGE={stage}" if stage else "full: the README's commands as written"
    rows = [f"| root file system (mmdebstrap {suite}: {', '.join(PACKAGES)}) | 0 | {build_s:.0f} |"]
    for s in done:
        status = "not run" if s.status is None else s.status
        rows.append(f"| {s.what}: `{s.command}` | {status} | {s.seconds:.0f} |")
    lines = [
        f"# Clean-machine test: Debian {suite} ({mode})",
        "",
        "Made by `make test-clean-machine` (instructor/clean_machine.py). "
        f"Run {started} on {load_before}; inside: {inside}. Source: {described}.",
        "pip's sources, bound read-only: " + (", ".join(f"`{p}`" for p in sources.binds) or "none (PyPI only)")
        + (f"; PIP_* passed: {', '.join(sorted(sources.env))}" if sources.env else "") + ".",
        "",
        "| step | exit | wall s |",
        "|---|---|---|",
        *rows,
        "",
        f"Verdict: {'PASS' if ok else 'FAIL'}: {why} ({SUITES[suite]}).",
    ]
    if suite in TOO_OLD and done:
        lines += ["", f"What `{done[0].command}` printed (last lines):", "", "```",
                  *[line for line in done[0].tail[-12:]], "```"]
    return "\n".join(lines) + "\n"


def ensure_tools() -> str | None:
    """None when root with mmdebstrap and unshare (mmdebstrap installed with apt-get if missing), else why not."""
    if os.geteuid() != 0:
        return "needs root (mmdebstrap, unshare and chroot as root)"
    if shutil.which("mmdebstrap") is None and shutil.which("apt-get"):
        print("+ apt-get install -y mmdebstrap", flush=True)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.call(["apt-get", "install", "-y", "-qq", "mmdebstrap"], env=env) != 0:
            subprocess.call(["apt-get", "update", "-qq"], env=env)
            subprocess.call(["apt-get", "install", "-y", "-qq", "mmdebstrap"], env=env)
    missing = [t for t in ("mmdebstrap", "unshare", "chroot") if shutil.which(t) is None]
    return f"missing {', '.join(missing)} (apt-get install -y mmdebstrap util-linux coreutils)" if missing else None


def mounted_under(path: Path) -> list[str]:
    """Mount points at or under ``path`` in this namespace (there should be none: every mount is the step's own)."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = [line.split()[4] for line in lines]
    return [p for p in points if p == str(path) or p.startswith(str(path).rstrip("/") + "/")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m instructor clean-machine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), default="bookworm", help="Debian release (default bookworm)")
    parser.add_argument("--quick", action="store_true", help="the README's commands with STAGE=1")
    parser.add_argument("--stage", help="the README's commands with STAGE=this (implies --quick)")
    parser.add_argument("--source", choices=("worktree", "head"), default="worktree",
                        help="worktree (default: tracked and unignored files as they are now) or head (git archive)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "llmsys-clean-machine")
    parser.add_argument("--keep", action="store_true", help="keep the root file system afterwards")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the results table")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds one step may take")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = parser.parse_args(argv)
    stage = args.stage or ("1" if args.quick else None)
    plan = [Step(what, cmd) for what, cmd in steps(stage)]
    sources = pip_sources()
    env = guest_env(sources)
    if args.dry_run:
        print(f"suite: {args.suite} ({SUITES[args.suite]})\npackages: {' '.join(PACKAGES)}")
        print("bound read-only: " + " ".join(map(str, sources.binds)))
        print("environment: " + " ".join(f"{k}={v}" for k, v in env.items()))
        for s in plan:
            print(f"step: {s.what}: {s.command}")
        return 0
    why_not = ensure_tools()
    if why_not:
        print(f"clean-machine: {why_not}", file=sys.stderr)
        return 2
    work = args.workdir / args.suite
    if mounted_under(args.workdir):
        print(f"clean-machine: something is mounted under {args.workdir}: unmount it first", file=sys.stderr)
        return 2
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load_before = machine()
    root = work / "root"
    log_path = work / "log.txt"
    try:
        print(f"== [root file system] mmdebstrap {args.suite} → {root}", flush=True)
        t0 = time.monotonic()
        built = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={','.join(PACKAGES)}",
                                args.suite, str(root)], capture_output=True, text=True)
        build_s = time.monotonic() - t0
        if built.returncode != 0:
            print(built.stdout[-3000:] + built.stderr[-3000:], file=sys.stderr)
            print(f"clean-machine: mmdebstrap {args.suite} failed (exit {built.returncode})", file=sys.stderr)
            return 2
        described = copy_checkout(root / GUEST.lstrip("/"), args.source)
        prepare_binds(root, sources.binds)
        with open(log_path, "w") as log:
            probe = run_step(Step("python", "python3 -V"), root, sources.binds, env, log, 60)
            inside = f"Debian {args.suite}, {probe.tail[-1] if probe.tail else 'python3: ?'}"
            done = []
            for step in plan:
                done.append(run_step(step, root, sources.binds, env, log, args.timeout))
                if args.suite not in TOO_OLD and step.status != 0:
                    break
        ok, why = verdict(args.suite, done)
        done += plan[len(done):]
        text = report(args.suite, stage, described, inside, sources, build_s, done, ok, why, started, load_before)
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out / f"clean-machine-{args.suite}{'-quick' if stage else ''}.md"
        out.write_text(text)
        print("\n" + text + f"\nwrote {out}; the whole output: {log_path}")
        return 0 if ok else 1
    finally:
        if not args.keep and not mounted_under(work):
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

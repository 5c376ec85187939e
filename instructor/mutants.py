"""Mutation testing of the graded suite: does every catalogued mistake fail a public test?

    python -m instructor mutants                  # every stage's catalogue
    python -m instructor mutants --stage 4        # one stage (``make mutants STAGE=4``)
    python -m instructor mutants --stage auto     # one stage the last commit touched, else one by rotation (CI)
    python -m instructor mutants --stage auto --budget 420   # CI: as many as fit in 7 minutes, rotating daily
    python -m instructor mutants --stage 4 --only sum-not-average

A grade means something only if wrong answers lose points. The catalogue (``tests/kit/mutants/stage<N>.py``,
instructor-only: it never ships in the release) lists, per stage, the mistakes students plausibly make —
the ones the handout warns about first — each as a small find/replace patch of the reference. For each
mutant this module builds a grading tree whose ``student/`` package is the reference with that one patch,
runs the stage's **public** tests (in a student's order, until one fails with a message that points at the
mistake: the rest cannot change the verdict — :mod:`instructor.stop_on_match`), and reports:

* ``killed``    — a public test failed; when the mutant gives ``expect`` (a regular expression), some failing
  test's message must match it, i.e. point at the mistake (``unpointed`` otherwise); the report names that test
  and the first line of its message;
* ``survived``  — every public test passed: the suite cannot tell this mistake from the right answer;
* ``justified`` — it survives the public tests for a reason written in ``survives``, and the hidden test
  named in ``hidden_test`` catches it (checked: a justified survivor that its hidden test misses fails);
* ``gpu-only``  — a mistake that changes nothing on a CPU (``needs_gpu`` says why and which public test catches
  it on a GPU): judged like any other where CUDA is present (``make gpu-check``'s machine), reported and not
  judged on a CPU.

A catalogue entry whose ``find`` text no longer occurs in the reference is an error, so the catalogue
cannot silently drift from the code.

The other half of a meaningful grade is that *reasonable designs pass*. ``tests/kit/designs/stage<N>/<name>/``
holds alternative implementations (complete modules named as in ``reference/``, e.g. ``ddp.py``, plus a
``README.md`` saying how the design differs). Each is overlaid on the reference and must pass every public
and hidden test of its stage (verdict ``passed``; ``failed`` names the first failing test). They run with the
stage's mutants (``--designs-only`` runs just them).

The exit status is non-zero when any mutant is not accounted for or any design fails.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from instructor import designs as alternative_designs
from instructor.trials import Verdict, build_tree, failures, first_failure, headline, run_tests
from kit import stages as stage_registry

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "tests" / "kit" / "mutants"
OUTPUT = ROOT / "mutants-output"


@dataclass(frozen=True)
class Mutant:
    """One plausible mistake, as a patch of the reference.

    Attributes:
        name: short kebab-case id, unique within the stage.
        file: the patched module, relative to ``reference/`` (e.g. ``"ddp.py"``).
        find: exact text in that module; must occur exactly ``count`` times.
        replace: what the mistaken student wrote instead.
        mistake: one sentence: what is wrong and which handout section warns about it.
        expect: optional regular expression the first failure's message must match (case-insensitive),
            so a mutant is "killed with a message that points at it", not merely killed.
        survives: why no public test can catch it (only for known survivors).
        hidden_test: the hidden test function that must catch a justified survivor.
        needs_gpu: why the mistake only shows on a GPU and which public test catches it there; the mutant is not
            judged where CUDA is missing.
        count: how many times ``find`` occurs (all occurrences are replaced).
    """

    name: str
    file: str
    find: str
    replace: str
    mistake: str
    expect: str = ""
    survives: str = ""
    hidden_test: str = ""
    count: int = 1
    needs_gpu: str = ""


def load_catalogue(stage: int, catalogue: Path = CATALOGUE) -> list[Mutant]:
    """The mutants of one stage (``[]`` when the stage has no catalogue file)."""
    path = catalogue / f"stage{stage}.py"
    if not path.exists():
        return []
    spec = importlib.util.spec_from_file_location(f"_kit_mutants_stage{stage}", path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    mutants = list(module.MUTANTS)
    names = [m.name for m in mutants]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"{path}: duplicate mutant names {duplicates}")
    return mutants


def apply(mutant: Mutant, package: Path) -> None:
    """Patch ``package/<mutant.file>`` in place; ``LookupError`` when the catalogue no longer matches."""
    target = package / mutant.file
    if not target.exists():
        raise LookupError(f"{mutant.name}: reference/{mutant.file} does not exist")
    source = target.read_text()
    found = source.count(mutant.find)
    if found != mutant.count:
        raise LookupError(f"{mutant.name}: the find text occurs {found} time(s) in reference/{mutant.file}, "
                          f"the catalogue expects {mutant.count} — update the catalogue to the reference")
    target.write_text(source.replace(mutant.find, mutant.replace))


def judge(stage: int, mutant: Mutant, tree: Path, timeout: float) -> Verdict:
    """Mutate a fresh copy of the staged reference, run the stage's public tests, and classify the result."""
    verdict = Verdict(stage, mutant.name, mutant.mistake, "error")
    start = time.monotonic()
    package = tree / "student"
    pristine = tree / "student.pristine"
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(pristine, package)
    try:
        apply(mutant, package)
    except LookupError as exc:
        verdict.verdict, verdict.message = "stale", str(exc)
        return verdict
    if mutant.needs_gpu and not _cuda_available():
        verdict.verdict = "gpu-only"
        verdict.notes.append(f"not judged without CUDA: {mutant.needs_gpu}")
        return verdict
    code, junit, output = run_tests(tree, stage, stop_when=mutant.expect or ".*", timeout=timeout)
    found = failures(junit)
    pointing = [f for f in found if mutant.expect and re.search(mutant.expect, f[1], re.I | re.S)]
    failure = (pointing or found or [None])[0]
    if code == 0:
        if not mutant.survives:
            verdict.verdict = "survived"
        elif not mutant.hidden_test:
            verdict.verdict = "hidden-missed"
            verdict.notes.append("a justified survivor must name the hidden test that catches it")
        else:
            hcode, hjunit, _ = run_tests(tree, stage, hidden_test=mutant.hidden_test, timeout=timeout)
            caught = first_failure(hjunit)
            verdict.verdict = "justified" if hcode != 0 and caught else "hidden-missed"
            verdict.test, verdict.message = (caught[0], headline(caught[1])) if caught else (mutant.hidden_test, "")
            verdict.notes.append(f"survives the public tests: {mutant.survives}")
    elif failure is None:
        verdict.verdict, verdict.message = "error", headline(output)
    else:
        verdict.test, verdict.message = failure[0], headline(failure[1])
        pointed = not mutant.expect or bool(pointing)
        verdict.verdict = "killed" if pointed else "unpointed"
        if not pointed:
            verdict.notes.append(f"no failing test's message matches /{mutant.expect}/")
        if len(found) > 1:
            verdict.notes.append(f"{len(found)} public tests fail")
    verdict.seconds = round(time.monotonic() - start, 1)
    return verdict


def _cuda_available() -> bool:
    import torch  # here, not at the top: the catalogue and the CLI's --help need no torch

    return torch.cuda.is_available()


def baseline_passes(tree: Path, stage: int, timeout: float) -> str:
    """'' when the unmutated reference passes the stage's public tests in this tree, else why not."""
    code, junit, output = run_tests(tree, stage, timeout=timeout)
    if code == 0:
        return ""
    failure = first_failure(junit)
    return f"{failure[0]}: {headline(failure[1])}" if failure else headline(output)


def changed_stages(root: Path = ROOT) -> list[int]:
    """One stage for CI: of those whose modules, tests, catalogue or designs the last commit changed (else of
    all stages), the one today's date picks — so CI stays within its time budget and every stage gets its turn."""
    try:
        files = subprocess.run(["git", "diff", "--name-only", "HEAD~1", "HEAD"], cwd=root, capture_output=True,
                               text=True, timeout=30).stdout.split()
    except (OSError, subprocess.SubprocessError):
        files = []
    chosen = []
    for s in stage_registry.STAGES:
        owned = {f"tests/kit/mutants/stage{s.number}.py"} | {str(p.relative_to(root)) for p in s.test_paths(root)}
        prefixes = tuple(f"reference/{m}{end}" for m in s.modules for end in (".py", "/")) \
            + (f"tests/kit/designs/stage{s.number}/",)
        if any(f in owned or f.startswith(prefixes) for f in files):
            chosen.append(s.number)
    numbers = chosen or stage_registry.numbers()
    return [numbers[dt.date.today().toordinal() % len(numbers)]]


def _kind(item: Path) -> str:
    """``"shortcut"`` for a folder of tests/kit/shortcuts (must fail), ``"design"`` for one of tests/kit/designs."""
    return "shortcut" if alternative_designs.SHORTCUTS in item.parents else "design"


def judge_all(stage: int, work: list[Mutant | Path], trees: queue.Queue[Path], timeout: float,
              budget: float | None, started: float) -> tuple[list[Verdict], list[str]]:
    """Judge ``work`` (mutants and designs) with one run per tree of ``trees`` at a time: the verdicts in the
    order of ``work``, and the names left over once ``budget`` seconds have passed since ``started``."""
    from tqdm import tqdm

    judged: dict[int, Verdict] = {}
    left_over: list[str] = []
    lock = threading.Lock()
    bar = tqdm(total=len(work), desc=f"stage {stage} mutants and designs", unit="item")

    def one(index: int, item: Mutant | Path) -> None:
        with lock:
            late = budget is not None and bool(judged) and time.monotonic() - started > budget
        if late:
            with lock:
                left_over.append(item.name if isinstance(item, Mutant) else f"{_kind(item)}:{item.name}")
        else:
            tree = trees.get()  # a tree no other run is using
            try:
                if isinstance(item, Mutant):
                    verdict = judge(stage, item, tree, timeout)
                elif _kind(item) == "shortcut":
                    verdict = alternative_designs.judge_shortcut(stage, item, tree, timeout)
                else:
                    verdict = alternative_designs.judge_design(stage, item, tree, timeout)
            finally:
                trees.put(tree)
            with lock:
                judged[index] = verdict
        bar.update()

    with ThreadPoolExecutor(max_workers=max(1, trees.qsize())) as pool:
        for done in [pool.submit(one, i, item) for i, item in enumerate(work)]:
            done.result()
    bar.close()
    return [judged[i] for i in sorted(judged)], left_over  # in the order of work, whichever finished first


def run(stages: list[int], *, only: list[str] | None = None, timeout: float = 900.0, baseline: bool = True,
        designs: bool = True, mutants_too: bool = True, out: Path = OUTPUT,
        budget: float | None = None, jobs: int | None = None) -> list[Verdict]:
    """Judge every catalogued mutant and design of ``stages``; print a table per stage, write ``out/stage<N>.*``.

    ``jobs`` mutants are judged at once (default: as many as the grader would grade stage groups at once,
    :func:`kit.grading.running.grading_jobs`: 2 on 2 idle CPUs with 6 GiB free), each in a grading tree of
    its own. A run is mostly start-up — a Python process importing torch, a zygote, collection — and waits
    on its ranks, so one keeps about one CPU busy. The limits count CPU time, not the clock, so a verdict
    does not depend on the other run (``make mutants`` checks it: every design must still pass).

    With ``budget`` (seconds), no new mutant or design starts once that much time has passed (each stage
    judges at least one). The list is rotated by today's date first, so that successive CI runs, each within
    its time limit, cover all of it. Those left over are named in the report, not counted as caught."""
    from kit.grading.running import grading_jobs

    jobs = max(1, jobs or grading_jobs())

    verdicts: list[Verdict] = []
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for stage in stages:
        mutants = [m for m in load_catalogue(stage) if not only or m.name in only] if mutants_too else []
        shortcuts = ([s for s in alternative_designs.load_shortcuts(stage) if not only or f"shortcut:{s.name}" in only]
                     if mutants_too else [])
        # --only narrows the designs only when it names some (design:NAME): a changed test must still let every
        # design pass, so `--only my-mistake` judges that mistake and all the stage's designs.
        named_designs = [n for n in only or [] if n.startswith("design:")]
        alternatives = ([d for d in alternative_designs.load_designs(stage)
                         if not named_designs or f"design:{d.name}" in named_designs] if designs else [])
        if not mutants and not shortcuts and not alternatives:
            print(f"stage {stage}: no catalogued mutants or designs" + (f" named {only}" if only else ""))
            continue
        work: list[Mutant | Path] = [*mutants, *shortcuts, *alternatives]
        if budget is not None and work:
            shift = dt.date.today().toordinal() % len(work)
            work = work[shift:] + work[:shift]
        with tempfile.TemporaryDirectory(prefix=f"kit-mutants-{stage}-") as tmp:
            trees: queue.Queue[Path] = queue.Queue()
            for i in range(min(jobs, len(work))):
                tree = build_tree(Path(tmp) / str(i))
                (tree / "student").rename(tree / "student.pristine")
                shutil.copytree(tree / "student.pristine", tree / "student")
                if i == 0 and baseline and (why := baseline_passes(tree, stage, timeout)):
                    raise RuntimeError(f"stage {stage}: the unmutated reference fails its own public tests in the "
                                       f"mutant tree, so no verdict would mean anything: {why}")
                trees.put(tree)
            stage_verdicts, left_over = judge_all(stage, work, trees, timeout, budget, started)
        verdicts += stage_verdicts
        report = format_report(stage, stage_verdicts)
        if left_over:
            report += (f"\n\nNot run within the {budget:g} s budget ({len(left_over)}; a later day's rotation "
                       f"reaches them, `make mutants STAGE={stage}` runs all): {', '.join(left_over)}")
        print(report)
        (out / f"stage{stage}.md").write_text(report + "\n")
        (out / f"stage{stage}.json").write_text(json.dumps([asdict(v) for v in stage_verdicts], indent=2))
    return verdicts


def format_report(stage: int, verdicts: list[Verdict]) -> str:
    mistakes = [v for v in verdicts if not v.name.startswith("design:")]
    designs = [v for v in verdicts if v.name.startswith("design:")]
    gpu_only = sum(v.verdict == "gpu-only" for v in mistakes)  # accounted for, but not caught: nothing was judged
    lines = [f"## Stage {stage} — {stage_registry.get(stage).title}: "
             f"{sum(v.accounted for v in mistakes) - gpu_only}/{len(mistakes)} mistakes caught, "
             + (f"{gpu_only} only judged on a GPU, " if gpu_only else "")
             + f"{sum(v.accounted for v in designs)}/{len(designs)} alternative designs pass", "",
             "| mutant or design | verdict | caught by / first failure | message | s |", "|---|---|---|---|---|"]
    for v in verdicts:
        message = (v.message + ("; " + "; ".join(v.notes) if v.notes else "")).replace("|", "\\|")
        lines.append(f"| {v.name} | {v.verdict} | {v.test} | {message[:300]} | {v.seconds:g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m instructor mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", help="stage numbers (e.g. 4 or 1,3), 'auto' (changed or rotating), default all")
    parser.add_argument("--only", help="only these mutants (comma-separated names; shortcut:NAME for a shortcut); "
                                       "the stage's designs still run unless --no-designs or some design:NAME is named")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test run")
    parser.add_argument("--no-baseline", action="store_true", help="skip checking that the reference passes first")
    parser.add_argument("--designs-only", action="store_true", help="only the alternative designs (tests/kit/designs)")
    parser.add_argument("--no-designs", action="store_true", help="only the mutants")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: start no new mutant after this long (the order rotates daily); for CI")
    parser.add_argument("--jobs", type=int, default=None,
                        help="mutants judged at once, each in its own tree (default: 2 on 2 idle CPUs, else 1)")
    args = parser.parse_args(argv)
    if args.stage == "auto":
        chosen = changed_stages()
    else:
        try:
            chosen = stage_registry.parse_stage_list(args.stage) or stage_registry.numbers()
        except ValueError as exc:
            parser.error(str(exc))
    verdicts = run(chosen, only=args.only.split(",") if args.only else None, timeout=args.timeout,
                   baseline=not args.no_baseline, designs=not args.no_designs, mutants_too=not args.designs_only,
                   budget=args.budget, jobs=args.jobs)
    bad = [v for v in verdicts if not v.accounted]
    missing = ", ".join(f"stage {v.stage} {v.name} ({v.verdict})" for v in bad)
    gpu_only = [v.name for v in verdicts if v.verdict == "gpu-only"]
    print(f"\n{len(verdicts) - len(bad) - len(gpu_only)}/{len(verdicts)} catalogued mistakes caught and designs passed"
          + (f"; {len(gpu_only)} only judged on a GPU ({', '.join(gpu_only)})" if gpu_only else "")
          + (f"; not accounted for: {missing}" if bad else ""))
    return 1 if bad or not verdicts else 0


if __name__ == "__main__":
    sys.exit(main())

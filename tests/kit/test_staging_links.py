"""Staging never follows what a submission controls: links, hard links, pipes and devices are refused and named.

A submission's ``student`` folder (or files in it) linked to the instructor's ``reference/`` scored full marks
when staging followed links, and links to the hidden tests or ``/proc/self/environ`` copied their contents into
the grading tree, where the submission's own code could print them. Zip files and git repositories both carry
symbolic links, so every such submission here is built at test time in a temporary folder (a link committed
to the kit would point into whoever's checkout it lands in).
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from kit.grading import batch, reporting, running, staging
from kit.grading.scoring import GradeResult

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "reference"
JUDGE_HALF = ROOT / "tests" / "hidden" / "test_stage1_hidden.py"
# Lines only the solution and the judge half hold, which no legitimate failure prints (a comment, a solution
# marker): if one shows in a test's output, a file the submission linked to was read.
SOLUTION_LINE = 'rows.sort(key=lambda r: r["self_time_us"], reverse=True)'
JUDGE_LINE = "a wrong mask alignment moves outputs by O(0.1)"
ONLY_REGULAR = "(only regular files and folders are graded"


def _submission(root: Path) -> Path:
    """A copy of the stubs in ``root/student``, as a student would upload them; returns ``root``."""
    shutil.copytree(ROOT / "student", root / "student", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def _refused(notes: list[str], where: str, why: str) -> None:
    wanted = f"refused {where}: {why}"
    assert any(n.startswith(wanted) and ONLY_REGULAR in n for n in notes), f"no note {wanted!r} in {notes}"


# ---- what is refused, and how it is said ---------------------------------------------------------------------


def test_a_student_folder_that_is_a_link_is_refused_and_graded_as_empty(tmp_path: Path):
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "student").symlink_to(REFERENCE, target_is_directory=True)
    files, notes = staging.gradable_files(sub)
    assert files == {}
    assert notes == [f"refused student: a symbolic link {ONLY_REGULAR}: submit the files themselves, not links to "
                     "them); graded as an empty submission"], notes
    dest = tmp_path / "tree"
    assert staging.stage_submission(sub, dest) == notes
    assert (dest / "student").is_dir() and not any((dest / "student").iterdir()), "an empty student package"
    (tmp_path / "empty" / "student").mkdir(parents=True)
    assert staging.content_hash(sub) == staging.content_hash(tmp_path / "empty"), "the same as an empty upload"


def test_a_nested_student_folder_or_the_student_folder_itself_that_is_a_link_is_refused(tmp_path: Path):
    repo = tmp_path / "unzipped" / "repo"
    repo.mkdir(parents=True)
    (repo / "student").symlink_to(REFERENCE, target_is_directory=True)
    files, notes = staging.gradable_files(tmp_path / "unzipped")
    assert files == {}
    _refused(notes, "repo/student", "a symbolic link")
    # The grader pointed at a submission's student/ that is a link: the link is the submission's, not the grader's.
    files, notes = staging.gradable_files(repo / "student")
    assert files == {}
    _refused(notes, "student", "a symbolic link")


def test_a_link_to_a_repository_is_not_followed_and_the_error_says_so(tmp_path: Path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "repo").symlink_to(ROOT, target_is_directory=True)  # ROOT holds a student/ folder
    with pytest.raises(FileNotFoundError, match=r"no student/ folder \(symbolic links are not followed: repo\)"):
        staging.gradable_files(tmp_path / "sub")


def test_a_linked_file_is_refused_and_not_staged(tmp_path: Path):
    sub = _submission(tmp_path / "sub")
    (sub / "student" / "benchmarking.py").unlink()
    (sub / "student" / "benchmarking.py").symlink_to(REFERENCE / "benchmarking.py")
    (sub / "student" / "dangling.py").symlink_to(tmp_path / "nothing-here.py")
    files, notes = staging.gradable_files(sub)
    assert Path("benchmarking.py") not in files and Path("dangling.py") not in files and Path("ddp.py") in files
    _refused(notes, "student/benchmarking.py", "a symbolic link")
    _refused(notes, "student/dangling.py", "a symbolic link")
    dest = tmp_path / "tree"
    staging.stage_submission(sub, dest)
    assert not (dest / "student" / "benchmarking.py").exists() and (dest / "student" / "ddp.py").is_file()


def test_a_link_to_a_folder_inside_student_is_refused_and_not_walked(tmp_path: Path):
    sub = _submission(tmp_path / "sub")
    shutil.rmtree(sub / "student" / "flash_attention")
    (sub / "student" / "flash_attention").symlink_to(REFERENCE / "flash_attention", target_is_directory=True)
    files, notes = staging.gradable_files(sub)
    assert not any(rel.parts[0] == "flash_attention" for rel in files), "nothing is taken from under a link"
    _refused(notes, "student/flash_attention", "a symbolic link")
    assert not any("flash_attention/" in n for n in notes), f"the link was walked into: {notes}"
    dest = tmp_path / "tree"
    staging.stage_submission(sub, dest)
    assert not (dest / "student" / "flash_attention").exists()


def test_a_hard_link_is_refused_it_may_be_a_second_name_of_a_file_outside(tmp_path: Path):
    sub = _submission(tmp_path / "sub")
    outside = tmp_path / "instructor_only.py"  # a hard link needs the same file system: the test's, not the kit's
    outside.write_text("SECRET = 'the expected values'\n")
    os.link(outside, sub / "student" / "expected.py")
    files, notes = staging.gradable_files(sub)
    assert Path("expected.py") not in files
    _refused(notes, "student/expected.py", "a hard link (one of 2 names of the same file")


def test_pipes_and_sockets_are_refused_and_never_opened(tmp_path: Path):
    sub = _submission(tmp_path / "sub")
    os.mkfifo(sub / "student" / "pipe.py")  # opened for reading, it would block staging until someone writes
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(sub / "student" / "sock.py"))
        files, notes = staging.gradable_files(sub)
        staging.stage_submission(sub, tmp_path / "tree")  # returns: nothing was opened
    assert Path("pipe.py") not in files and Path("sock.py") not in files
    _refused(notes, "student/pipe.py", "a named pipe (FIFO)")
    _refused(notes, "student/sock.py", "a socket")


def test_a_file_swapped_for_a_link_after_the_walk_is_not_read(tmp_path: Path):
    """``O_NOFOLLOW`` on the copy: a link that replaced a file since :func:`gradable_files` looked is refused."""
    sub = _submission(tmp_path / "sub")
    files, _ = staging.gradable_files(sub)
    target = sub / "student" / "benchmarking.py"
    target.unlink()
    target.symlink_to(REFERENCE / "benchmarking.py")
    with pytest.raises(staging.RefusedEntry, match="refused student/benchmarking.py: a symbolic link"):
        with staging.open_regular(files[Path("benchmarking.py")], "student/benchmarking.py"):
            pass


def test_a_regular_submission_is_staged_byte_for_byte(tmp_path: Path):
    sub = _submission(tmp_path / "sub")
    (sub / "student" / "benchmarking.py").write_bytes((REFERENCE / "benchmarking.py").read_bytes() + b"# \xc3\xa9\n")
    (sub / "notes.txt").write_text("ignored\n")
    files, notes = staging.gradable_files(sub)
    assert not any(n.startswith("refused") for n in notes), notes
    dest = tmp_path / "tree"
    staging.stage_submission(sub, dest)
    staged = {p.relative_to(dest / "student"): p.read_bytes() for p in (dest / "student").rglob("*") if p.is_file()}
    assert staged == {rel: path.read_bytes() for rel, path in files.items()}
    assert set(files) == {p.relative_to(sub / "student") for p in (sub / "student").rglob("*.py")}
    assert staging.content_hash(sub) == staging.content_hash(dest), "the hash is of exactly what is staged"


# ---- the attacks, graded -------------------------------------------------------------------------------------

# A regular module of submission (b): it shows whatever staging copied next to it. Were the links followed, the
# reference's solution, the judge half and the grader's environment would be in the test output.
LEAKER = '''from pathlib import Path

here = Path(__file__).parent
found = {n: (here / n).read_text(errors="replace") for n in ("judge.py", "environ.py", "benchmarking.py", "__init__.py")
         if (here / n).exists()}
raise ImportError(f"what staging copied here: {found!r}")
'''
LINK_ATTACKS = ("linked_files", "linked_student")


def _build_link_attacks(folder: Path) -> None:
    """(a) ``student`` is a link to ``reference/``; (b) the package's ``__init__.py`` and ``benchmarking.py`` are
    links into ``reference/``, beside links to the hidden judge half and ``/proc/self/environ`` and two regular
    modules that print what they find."""
    (folder / "linked_student").mkdir(parents=True)
    (folder / "linked_student" / "student").symlink_to(REFERENCE, target_is_directory=True)
    student = folder / "linked_files" / "student"
    student.mkdir(parents=True)
    for name in ("__init__.py", "benchmarking.py"):
        (student / name).symlink_to(REFERENCE / name)
    (student / "judge.py").symlink_to(JUDGE_HALF)
    (student / "environ.py").symlink_to("/proc/self/environ")
    for name in ("precision.py", "ddp.py"):  # Stage 2's and Stage 4's modules
        (student / name).write_text(LEAKER)


def _grader_environment() -> list[str]:
    """``KEY=value`` entries of this process's environment (the grader's: it stages in-process), what a followed
    link to ``/proc/self/environ`` would have copied. Whole entries: the graded tests never print one."""
    entries = Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
    return [e for e in entries if len(e.partition("=")[2]) >= 8]


@pytest.fixture(scope="module")
def link_attacks(tmp_path_factory) -> tuple[dict[str, GradeResult], float]:
    """Both attacks graded as one batch on every stage with the hidden tests: 33 s on an idle 2-core machine (55 s
    beside other tests), since a package without its links has no stage module that works and each test fails at
    its module's import check: cheap enough to grade every stage rather than a sample of them."""
    folder = tmp_path_factory.mktemp("link-attacks")
    _build_link_attacks(folder)
    limits = running.Limits(timeout=180, per_test_timeout=60, memory_gb=2, idle_limit=5, timing_floor=5)
    start = time.monotonic()
    report = batch.grade_batch(folder, tmp_path_factory.mktemp("link-grades"), limits=limits, jobs=2,
                               include_hidden=True)
    return {r.submission: r for r in report.results}, time.monotonic() - start


def test_the_distinctive_lines_are_in_the_files_linked_to():
    assert SOLUTION_LINE in (REFERENCE / "benchmarking.py").read_text(), "pick another line of the solution"
    assert JUDGE_LINE in JUDGE_HALF.read_text(), "pick another line of the judge half"


def test_link_attacks_score_zero_and_the_refusals_are_reported(link_attacks):
    results, seconds = link_attacks
    print(f"graded {LINK_ATTACKS} in {seconds:.1f} s")
    assert sorted(results) == sorted(LINK_ATTACKS)
    for name, result in results.items():
        assert result.status == "ok" and result.max_score > 0, f"{name}: {result.status}: {result.message}"
        assert result.score == 0, f"{name} scored {result.score}:\n{reporting.format_table(result)}"
        # Zero because the package is empty, not because the kit broke: every test says its module is missing.
        unclear = [t.nodeid for t in result.tests if "did not import" not in t.output]
        assert not unclear, f"{name}: these tests failed for another reason than a module missing: {unclear}"
    assert "refused student: a symbolic link" in results["linked_student"].message
    assert "graded as an empty submission" in results["linked_student"].message
    message = results["linked_files"].message
    for name in ("__init__.py", "benchmarking.py", "judge.py", "environ.py"):
        assert f"refused student/{name}: a symbolic link" in message, message
    # Its regular modules ran and found nothing beside them: no link's target was copied into the grading tree.
    assert "what staging copied here: {}" in "\n".join(t.output for t in results["linked_files"].tests)


def test_nothing_a_link_points_to_reaches_the_output(link_attacks):
    results, _ = link_attacks
    environment = _grader_environment()
    for name, result in results.items():
        text = "\n".join([result.output, result.message, *(t.output for t in result.tests)])
        assert SOLUTION_LINE not in text, f"{name}: the reference's solution is in the output"
        assert JUDGE_LINE not in text, f"{name}: the hidden judge half is in the output"
        leaked = [e.split("=", 1)[0] for e in environment if e in text]
        assert not leaked, f"{name}: the grader's environment ({leaked}) is in the output"

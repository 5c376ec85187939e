"""The open stub level (``make student LEVEL=open``): only the public API, none of the given scaffolding.

Graded as a submission, every test must fail with the stubs' ``NotImplementedError`` — never with an
``AttributeError``, ``ImportError`` or ``NameError``. That is the evidence that the tests reach the
implementation through its public API only: a test that touched a private helper or attribute of the
reference's design would fail differently here.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from instructor import release

ROOT = Path(__file__).resolve().parents[2]
WRONG_FAILURES = ("AttributeError", "ImportError", "ModuleNotFoundError", "NameError", "UnboundLocalError")


def _public_api(source: str) -> dict[str, str]:
    """``{qualified name: signature}`` of the public functions, classes and methods of a module."""
    api: dict[str, str] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and (
                    not node.name.startswith("_") or node.name.endswith("__")):
                if isinstance(node, ast.ClassDef):
                    api[prefix + node.name] = "class(" + ", ".join(ast.unparse(b) for b in node.bases) + ")"
                    visit(node.body, prefix + node.name + ".")
                else:
                    api[prefix + node.name] = ast.unparse(node.args)

    visit(ast.parse(source).body, "")
    return api


def test_open_level_keeps_every_public_signature_and_drops_the_scaffolding():
    guided, open_ = release.render_student(level="guided"), release.render_student(level="open")
    assert guided.keys() == open_.keys()
    for rel in guided:
        if rel.suffix == ".py":
            assert _public_api(open_[rel].decode()) == _public_api(guided[rel].decode()), rel
    ddp, zero = open_[Path("ddp.py")].decode(), open_[Path("zero.py")].decode()
    pipeline = open_[Path("parallel/pipeline_parallel.py")].decode()
    for gone in ("_launch_bucket", "_buffers", "_bucket_of", "_on_grad_ready", "_pending"):
        assert gone not in ddp, gone
    for gone in ("_local_group", "_copy_options", "_global_indices", "_owner", "_loads"):
        assert gone not in zero, gone
    for gone in ("_Step", "_forward_op", "_backward_op"):
        assert gone not in pipeline, gone
    assert "def owner_of(self, param: torch.Tensor) -> int:" in zero  # the public API stays


def test_cli_builds_an_open_level_release(tmp_path):
    out = tmp_path / "open-release"
    proc = subprocess.run([sys.executable, "-m", "instructor", "release", "--build", "--level", "open",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (out / "reference").exists()
    assert (out / "student" / "ddp.py").read_bytes() == release.render_student(level="open")[Path("ddp.py")]
    dry = subprocess.run(["make", "-n", "student", "release", "LEVEL=open"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert "instructor release --student --level open" in dry.stdout
    assert "instructor release --build --level open" in dry.stdout


@pytest.fixture(scope="module")
def open_results(tmp_path_factory) -> dict:
    submission = tmp_path_factory.mktemp("open") / "submission"
    release.write_student(student=submission / "student", level="open")
    results = submission.parent / "results.json"
    env = {k: v for k, v in os.environ.items() if k != "LLMSYS_IMPL"}
    proc = subprocess.run([sys.executable, "-m", "kit", "grade", "--impl", str(submission), "--hidden",
                           "--json", str(results)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"grading the open level failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(results.read_text())


def test_open_level_tests_reach_only_the_public_api(open_results: dict):
    """No graded test (hidden ones included) fails on a missing private name: each fails on a stub."""
    wrong = []
    for t in open_results["tests"]:
        output = t.get("output", "")
        others = [name for name in WRONG_FAILURES if f"{name}:" in output]
        if others or (not t["score"] and "NotImplementedError" not in output):
            wrong.append(f"{t['name']}: failed with {others or 'no NotImplementedError'}\n{output[-1500:]}")
    assert len(open_results["tests"]) > 50
    assert not wrong, (f"{len(wrong)} graded tests fail at the open level for another reason than a stub's "
                       "NotImplementedError — they depend on more than the public API:\n\n" + "\n\n".join(wrong[:8]))


def test_open_level_scores_zero(open_results: dict):
    """A test that passes on stubs awards points for given code (e.g. argument checks alone)."""
    passing = [f"{t['name']} ({t['score']:g} points)" for t in open_results["tests"] if t["score"]]
    assert not passing, ("these graded tests pass on the open-level stubs, so their points pay for given code; "
                         "each needs a check of the student's own work too: " + ", ".join(passing))

"""Every notebook runs headless at CPU sizes against the reference, its .ipynb matches its .py twin, and it
uses only the public API (no path hacks, no private names, nothing from the benchmarks)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.py"))
pytestmark = pytest.mark.notebook


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_pair_in_sync(source: Path) -> None:
    import jupytext

    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} is missing: run `make notebooks`"
    from_py = [c.source for c in jupytext.read(source).cells]
    from_ipynb = [c.source for c in jupytext.read(ipynb).cells]
    assert from_py == from_ipynb, f"{ipynb.name} differs from {source.name}: run `make notebooks`"


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_uses_only_the_public_api(source: Path) -> None:
    code = "\n".join(line.split("#")[0] for line in source.read_text().splitlines())
    assert "sys.path" not in code, f"{source.name} edits sys.path: the kit is importable from the repository root"
    assert not re.search(r"^\s*(from|import)\s+benchmarks\b", code, re.M), (
        f"{source.name} imports a benchmark: move what it needs into the kit or the implementation's public API")
    private = re.findall(r"\b\w+\._[a-z]\w*", code)
    assert not private, f"{source.name} uses private names {private}: give them a public function"


@pytest.mark.parametrize("source", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import jupytext
    from nbclient import NotebookClient

    # The kernel inherits this environment: headless plots, the kit on its path, the selected impl.
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = jupytext.read(source)
    # Figures land in a scratch folder, not in the repository.
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

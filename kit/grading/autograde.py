"""``python -m kit autograde``: grade one uploaded submission the way Gradescope's ``run_autograder`` does.

It grades with the public and hidden tests and always leaves ``results.json`` behind, even when grading
itself fails. The bundle that calls it is built by the instructor's tooling (``make autograder``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kit.grading.running import Limits


def autograde(submission: Path, results: Path, *, stages: list[int] | None = None,
              limits: Limits | None = None) -> dict:
    """Grade one uploaded submission with the public and hidden tests; always write ``results``."""
    from kit.grading.reporting import gradescope_json
    from kit.grading.running import grade, grading_jobs

    results.parent.mkdir(parents=True, exist_ok=True)
    try:
        result = grade(str(submission), stages=stages, include_hidden=True, limits=limits, jobs=grading_jobs())
        data = gradescope_json(result)
        if result.status == "error":
            data["output"] = "The autograder could not run the tests on this submission. " + result.message
    except Exception as exc:  # the results file must exist even when grading itself failed
        data = {"score": 0, "execution_time": 0, "tests": [], "stdout_visibility": "hidden",
                "output": f"The autograder could not grade this submission: {type(exc).__name__}: {exc}"}
    tmp = results.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, results)
    return data

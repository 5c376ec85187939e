"""The autograder, one concern per module. Read them in this order:

* :mod:`~kit.grading.staging` — a clean grading tree holding only a submission's ``student/**/*.py``;
* :mod:`~kit.grading.running` — the graded suite in a sandboxed child process, with limits and resumes;
* :mod:`~kit.grading.processes` — the processes a run starts: reaping leftovers, stopping on a signal;
* :mod:`~kit.grading.events` — the child's signed event log, read as it grows;
* :mod:`~kit.grading.timings` — per-test time limits from the reference's recorded durations;
* :mod:`~kit.grading.plugin` — the judge: the pytest plugin of the graded process (limits, imports, events);
* :mod:`~kit.grading.imports` — each stage's modules imported once in a worker before its tests;
* :mod:`~kit.grading.scoring` — tests and points, named by stage and handout problem;
* :mod:`~kit.grading.reporting` — the score table and Gradescope's ``results.json``;
* :mod:`~kit.grading.gradebook` — ``gradebook.csv`` and its histogram;
* :mod:`~kit.grading.batch` — a folder of submissions, resumable after an interruption.

And what those stand on:

* :mod:`~kit.grading.sandbox` — the launcher of a graded run: resource limits, a watchdog, its process group;
* :mod:`~kit.grading.tree` — copy parts of the kit into another tree (grading trees, the release, bundles);
* :mod:`~kit.grading.library_rules` — what a submission may not call: the library version of what it builds;
* :mod:`~kit.grading.handout_check` — the handout, the tests and the points agree.

The child process (the judge) reports through :mod:`kit.grading.plugin`; the grader, not the child,
computes the points. This package imports nothing at start-up, so the judge imports only what it uses.
"""

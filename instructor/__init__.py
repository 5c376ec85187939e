"""The instructor's tools — never shipped to students (``make release`` leaves this package out).

* :mod:`~instructor.release` and :mod:`~instructor.stubs` — ``student/`` generated from ``reference/``, and the
  student release;
* :mod:`~instructor.autograder` — the Gradescope bundle;
* :mod:`~instructor.mutants` and :mod:`~instructor.designs` — does each catalogued mistake fail a public test,
  and does each alternative design pass;
* :mod:`~instructor.answer_key` — the answer key rendered from ``instructor/answers/``;
* :mod:`~instructor.gpu_check` — the whole GPU path in one command;
* :mod:`~instructor.timings` — every graded test's reference run, recorded for the grader's limits;
* :mod:`~instructor.scaffold` — the skeletons of a new stage.

``python -m instructor`` runs them; the Makefile's targets (``make student``, ``make mutants``, …) call it.
It may import anything in the repository (``kit``, ``reference``, ``benchmarks``); ``kit`` never imports it.
"""

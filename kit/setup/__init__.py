"""This machine and the kit's set-up: what ``make setup`` and ``python -m kit doctor`` run, one concern per module.

* :mod:`~kit.setup.python_check` — is this Python new enough (it runs on any Python 3, before ``.venv`` exists);
* :mod:`~kit.setup.bootstrap` — ``make setup``: install only what ``pyproject.toml`` asks for and is missing;
* :mod:`~kit.setup.doctor` — ``python -m kit doctor``: what this machine will run, and what that means per lab;
* :mod:`~kit.setup.portable` — a student's own machine: the portable path of the harness, a kit without Triton.

Like :mod:`kit` itself, this package imports nothing at start-up: ``python3 -m kit.setup.python_check`` must run
(and say what to install) on an interpreter too old for the rest of the kit.
"""

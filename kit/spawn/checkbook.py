"""Inside a worker: the checks the judge may ask for, fixed before any submission code runs.

The judge names a check by module and qualified name (it pickles the function by reference). Resolved the
usual way, through ``sys.modules``, that name is whatever the submission's import-time code made it: replace
``test_stage1_benchmarking._time_fn_with_fake_clock`` by a function returning a constant record and the check
never calls the code it grades. So a worker resolves names against a **checkbook** written before the
first request, in the zygote's fork (the zygote imports the judge's test modules, then forks; no submission
code has run in either):

* every module-level function and class of the test modules (graded test files, their support modules and
  the hidden tests' worker halves) and of the kit, by module and name, is taken from the checkbook, not from
  the live module (:func:`resolve`);
* what those functions and classes are made of is recorded too: each function's code and defaults, each
  module's names, each class's attributes. :func:`tampering` compares them with the live objects, and the
  worker refuses to run a request, or to report a value, when anything differs ("the submission replaced
  ``test_stage1_benchmarking._stats``"): a helper that a check looks up at call time cannot be swapped either.

This is a guard against the plain forgery, not a proof: code in the same process can always undo what the
process does (INSTRUCTOR.md, threat model). The verdicts that matter rest on inputs the judge chooses and values it
computes itself, which a forged record has to match.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

__all__ = ["resolve", "tampering", "test_modules", "write"]

_FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")
_entries: dict[str, dict[str, Any]] = {}  # module → {name: object} as it was before any submission code ran
_parts: dict[int, tuple[Any, tuple]] = {}  # id(object) → (the object, what it was made of)


def test_modules(tests: Path) -> list[str]:
    """The names of the modules in ``sys.modules`` (the judge's) whose files are test modules under ``tests``: what
    a worker must resolve checks from. The kit's own tests (``tests/kit``) and conftest files are not graded."""
    tests = tests.resolve()
    names = []
    for name, module in list(sys.modules.items()):
        key = (str(tests), name, id(module))
        if key not in _is_test_module:  # resolving ~1,300 paths on every fork cost the judge 44 ms a rank
            file = getattr(module, "__file__", None)
            path = Path(file).resolve() if file and not name.endswith("conftest") else None
            _is_test_module[key] = bool(path and path.is_relative_to(tests) and not path.is_relative_to(tests / "kit"))
        if _is_test_module[key]:
            names.append(name)
    return sorted(names)


_is_test_module: dict[tuple[str, str, int], bool] = {}  # (tests folder, module name, module id) → a test module?


_METHODS = (types.FunctionType, staticmethod, classmethod, property)


def _made_of(obj: Any) -> tuple:
    """A function's code and defaults; a class's methods (not its data attributes, which a class may change)."""
    if isinstance(obj, types.FunctionType):
        return tuple(getattr(obj, part) for part in _FUNCTION_PARTS)
    if isinstance(obj, type):
        return tuple(sorted((k, id(v)) for k, v in vars(obj).items() if isinstance(v, _METHODS)))
    return ()


def write(test_names: list[str]) -> None:
    """Record the checkbook: every function and class defined in the kit's modules and in ``test_names``. Call it
    before any submission code runs in this process (the worker does, first thing)."""
    tests = set(test_names)
    for name, module in list(sys.modules.items()):
        if module is None or not (name in tests or name == "kit" or name.startswith("kit.")):
            continue
        own = {k: v for k, v in vars(module).items() if isinstance(v, (types.FunctionType, type))}
        _entries[name] = dict(vars(module))
        for obj in own.values():
            _parts[id(obj)] = (obj, _made_of(obj))


def resolve(module: str, qualname: str) -> Any:
    """``module.qualname`` as the checkbook has it; ``KeyError`` when the checkbook does not hold the module."""
    target = _entries[module][qualname.split(".")[0]]
    for part in qualname.split(".")[1:]:
        target = getattr(target, part)
    return target


def tampering() -> str | None:
    """What the submission changed in the checkbook's modules, in words; None when nothing was."""
    for name, recorded in _entries.items():
        module = sys.modules.get(name)
        if module is None:
            return f"module {name} was removed from sys.modules"
        live = vars(module)
        for key, value in recorded.items():
            if isinstance(value, (types.FunctionType, type)) and live.get(key) is not value:
                return f"{name}.{key} was replaced"
    for obj, parts in _parts.values():
        if _made_of(obj) != parts:
            return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')} was changed"
    return None

"""Is this Python new enough for the kit? ``make setup`` asks before it makes ``.venv``; ``kit.setup.bootstrap`` asks
too.

It runs on any Python 3 (the standard library only, nothing 3.11-only), so that an old interpreter gets a message
that says what to install instead of a traceback (``tomllib``, new in 3.11, is the first thing the set-up needs)::

    python3 -m kit.setup.python_check        # exit 0, silent, on Python >= 3.11; else the message and exit 1
"""

from __future__ import annotations

import sys

MINIMUM = (3, 11)


def too_old(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    return tuple(version[:2]) < MINIMUM


def message(version: tuple[int, ...] = tuple(sys.version_info[:3]), executable: str = sys.executable,
            venv: str | None = sys.prefix if sys.prefix != sys.base_prefix else None) -> str:
    """What to do when ``version`` (of ``executable``, inside the virtual environment ``venv`` if any) is older
    than :data:`MINIMUM`."""
    need = ".".join(map(str, MINIMUM))
    found = ".".join(map(str, version))
    lines = [
        f"make setup: the kit needs Python {need} or newer; {executable} is Python {found}.",
        "Install a newer Python, then run `make setup` again:",
        "  - Debian 12 or Ubuntu 24.04: sudo apt install python3 python3-venv   (their python3 is 3.11 / 3.12)",
        f"  - an older Linux: install Python {need}+ (your distribution's python{need} package where it has one,"
        f" e.g. Ubuntu 22.04: sudo apt install python{need} python{need}-venv; else uv or pyenv),",
        f"    then: make setup PYTHON=python{need}",
        "  - macOS, Windows, or no way to install it: use the dev container (README.md, \"On macOS or Windows\")",
    ]
    if venv:
        lines.append(f"  ({venv} was made with this Python: remove it first, rm -rf {venv}, then make setup)")
    return "\n".join(lines)


def main() -> int:
    if too_old():
        print(message(), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

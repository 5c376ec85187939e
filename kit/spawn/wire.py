"""What a worker may send back: data in a safe format, never an object that runs code when it is read.

A worker runs a submission's code, so everything it sends is untrusted. The process that decides a grade
reads only two formats, neither of which can execute anything or bring an object with its own ``__eq__``:

tensors, ``bool``/``int``/``float``/``complex``/``str``/``bytes``/``None``, ``torch.dtype``, ``torch.device``,
``torch.Size`` and lists, tuples, sets and dicts of these, written with ``torch.save`` and read with
``torch.load(weights_only=True)``, which refuses every other type.

:func:`encode` (in the worker) turns what a check returns into that form, or fails saying which part of it
is not data (``value['stats'] is a TimingStats: return its fields``). :func:`decode` (in the judge) reads it
back and re-checks every type, so a hand-made message gains nothing. Every message a worker sends — a
check's value, a failure's description, a progress note — is one such value, a dict whose fields the
judge reads with :func:`field` (by name and type, with a default for anything else).
"""

from __future__ import annotations

import io
from typing import Any

__all__ = ["MAX_BYTES", "NotData", "decode", "encode", "field", "normalise"]

MAX_BYTES = 1 << 30  # the largest message the judge reads: 1 GiB
_SCALARS = (bool, int, float, complex, str, bytes, type(None))


class NotData(TypeError):
    """A check returned something that is not data (an object of its own class, a function, …)."""


def normalise(value: Any, path: str = "value") -> Any:
    """``value`` with every part a plain data type (see the module docstring); :class:`NotData` naming the
    first part that is not."""
    import torch

    if isinstance(value, torch.Tensor):
        # A plain tensor on the CPU, its own storage (a view would carry its whole base), no autograd graph.
        plain = value.detach().to("cpu")
        if type(plain) is not torch.Tensor:  # nn.Parameter, a subclass: keep the numbers only
            plain = torch.Tensor._make_subclass(torch.Tensor, plain)
        whole = (plain.is_contiguous() and plain.storage_offset() == 0
                 and plain.untyped_storage().nbytes() == plain.numel() * plain.element_size())
        return plain if whole else plain.clone(memory_format=torch.contiguous_format)
    if isinstance(value, bool):
        return bool(value)
    for kind in (int, float, complex, str, bytes):
        if isinstance(value, kind):
            return kind(value)  # a subclass (numpy.float64 is a float) becomes the builtin
    if value is None or isinstance(value, (torch.dtype, torch.device)):
        return value
    if type(value).__module__ == "numpy":  # numpy scalars and arrays
        import numpy

        if isinstance(value, numpy.ndarray):
            return torch.from_numpy(value.copy())
        if isinstance(value, numpy.generic):
            return normalise(value.item(), path)
    if isinstance(value, dict):
        return {normalise(k, f"{path} key {k!r}"): normalise(v, f"{path}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [normalise(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)  # torch.Size and namedtuples: plain tuples
    if isinstance(value, (set, frozenset)):
        return {normalise(v, f"{path} item") for v in value}
    raise NotData(
        f"{path} is a {type(value).__module__}.{type(value).__qualname__}: a check returns data only — tensors, "
        "numbers, strings, None, dtypes, and lists, tuples, sets and dicts of these. Return the object's "
        "numbers (its fields, its tensors) instead of the object.")


def encode(value: Any) -> bytes:
    """``value`` (normalised, or made of data) as bytes the judge can read safely."""
    import torch

    buffer = io.BytesIO()
    torch.save(normalise(value), buffer)
    return buffer.getvalue()


def _checked(value: Any, path: str) -> Any:
    """In the judge: every part of a decoded value is exactly one of the data types (no subclass, no object)."""
    import torch

    kind = type(value)
    if kind is torch.Tensor or kind in _SCALARS or kind in (torch.dtype, torch.device, torch.Size):
        return value
    if kind is dict:
        return {_checked(k, path): _checked(v, f"{path}[{k!r}]") for k, v in value.items()}
    if kind in (list, tuple):
        items = [_checked(v, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if kind is list else tuple(items)
    if kind is set:
        return {_checked(v, path) for v in value}
    raise NotData(f"{path}: a worker sent a {kind.__qualname__}, which is not data")


def decode(data: bytes) -> Any:
    """In the judge: the value of :func:`encode`'s bytes, read without running any code they carry."""
    import torch

    if len(data) > MAX_BYTES:
        raise NotData(f"a worker sent {len(data)} bytes; at most {MAX_BYTES} are read")
    return _checked(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"), "value")


def field(report: dict, name: str, kind: type, default: Any = None) -> Any:
    """A report's field, if it has the expected JSON type; ``default`` otherwise (a report is untrusted)."""
    value = report.get(name, default)
    if kind is int and isinstance(value, bool):
        return default
    return value if isinstance(value, kind) else default

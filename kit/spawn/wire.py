"""What a worker may send back: data in a safe format, never an object that runs code when it is read.

A worker runs a submission's code, so everything it sends is untrusted. The process that decides a grade
reads only two formats, neither of which can execute anything or bring an object with its own ``__eq__``:

tensors, ``bool``/``int``/``float``/``complex``/``str``/``bytes``/``None``, ``torch.dtype``, ``torch.device``,
``torch.Size`` and lists, tuples, sets and dicts of these, written with ``torch.save`` and read with
``torch.load(weights_only=True)``, which refuses every other type.

:func:`encode` (in the worker) turns what a check returns into that form, or fails saying which part of it
is not data (``value['stats'] is a TimingStats: return its fields``). :func:`decode` (in the judge) reads it
back and re-checks every type, so a hand-made message gains nothing, and reads only so much of it: at most
:data:`MAX_BYTES`, :data:`MAX_NODES` parts, :data:`MAX_DEPTH` levels and :data:`MAX_ELEMENTS` tensor elements,
every tensor whole (what :func:`normalise` sends: no view of a storage larger or smaller than itself). A
message past a limit is refused as not data, after at most the limit's work. Every message a worker sends — a
check's value, a failure's description, a progress note — is one such value, a dict whose fields the
judge reads with :func:`field` (by name and type, with a default for anything else).
"""

from __future__ import annotations

import gc
import io
from typing import Any

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_ELEMENTS", "MAX_NODES", "NotData", "decode", "encode", "field", "normalise"]

MAX_BYTES = 1 << 30  # the largest message the judge reads: 1 GiB
# What the judge spends on reading a message is bounded by its structure too, not by its bytes alone: the
# pickle's memo lets 1.7 KB refer to one list 2^60 times. Every graded test's messages, measured with the
# reference (stages 1-7 with the hidden tests): at most 6,468 parts, nested 7 deep, 525,056 tensor elements.
MAX_NODES = 1_000_000  # parts visited (a shared part each time): 150x the largest honest message, 2.5x a list of
#                        100,000 (a, b, c) tuples, and walked in under half a second when a message reaches it
MAX_DEPTH = 100  # levels of nesting: 14x the deepest honest message, and far from Python's recursion limit
MAX_ELEMENTS = MAX_BYTES  # tensor elements in all (a shared tensor each time): what MAX_BYTES of one-byte
#                           elements holds, 2,000x the largest honest message; only a message that refers to one
#                           storage many times can claim more, and every element is work for the comparisons
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


class _Walk:
    """In the judge: a decoded value walked as a tree and copied part by part, each part checked to be exactly one
    of the data types (no subclass, no object), each tensor whole, all within the structure limits.

    The pickle's memo lets a message of a kilobyte refer to one list again and again, so its tree can be
    exponentially larger than its bytes. The walk counts every visit (a shared part each time), and stops at
    the first limit, so a message costs the judge at most ``MAX_NODES`` visits whatever its shape, and what it
    returns is a tree of that size at most. Paths (``value['x'][3]``) go down as linked pairs, spelled out only
    in a refusal's message, not for every part.
    """

    __slots__ = ("elements", "leaves", "nodes", "tensor_type")

    def __init__(self) -> None:
        import torch

        self.nodes = 0
        self.elements = 0
        self.leaves = frozenset(_SCALARS + (torch.dtype, torch.device, torch.Size))
        self.tensor_type = torch.Tensor

    def value(self, value: Any, depth: int, at: tuple) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise NotData(f"the message has more than {MAX_NODES:,} parts (wire.MAX_NODES, counting a part the "
                          "message refers to several times each time), the most the judge reads. Send fewer: "
                          "numbers as tensors, not as lists of Python numbers")
        kind = type(value)
        if kind in self.leaves:
            return value
        if kind is self.tensor_type:
            return self.tensor(value, at)
        if depth > MAX_DEPTH:
            raise NotData(f"{_path(at)} is nested more than {MAX_DEPTH} levels deep (wire.MAX_DEPTH), the deepest "
                          "the judge reads")
        depth += 1
        if kind is list:
            return [self.value(v, depth, (at, i)) for i, v in enumerate(value)]
        if kind is tuple:
            return tuple([self.value(v, depth, (at, i)) for i, v in enumerate(value)])
        if kind is dict:
            return {self.value(k, depth, (at, _KEY)): self.value(v, depth, (at, k)) for k, v in value.items()}
        if kind is set:
            return {self.value(v, depth, (at, _ITEM)) for v in value}
        raise NotData(f"{_path(at)}: a worker sent a {kind.__qualname__}, which is not data")

    def tensor(self, tensor: Any, at: tuple) -> Any:
        import torch

        # What normalise() sends: a dense tensor that is the whole of its storage. A view (an offset, a stride
        # of 0, an expanded size) can claim far more elements than the message holds bytes.
        if tensor.layout is not torch.strided:
            raise NotData(f"{_path(at)} is a {tensor.layout} tensor, which is not data: a worker sends dense tensors")
        numel, stored = tensor.numel(), tensor.untyped_storage().nbytes()
        if not (tensor.is_contiguous() and tensor.storage_offset() == 0 and stored == numel * tensor.element_size()):
            raise NotData(f"{_path(at)} is a view, not a whole tensor, so it is not data: size {tuple(tensor.shape)}, "
                          f"strides {tensor.stride()}, offset {tensor.storage_offset()} in a storage of {stored} "
                          "bytes. A worker sends tensors that are their whole storage (wire.normalise makes them so)")
        self.elements += numel
        if self.elements > MAX_ELEMENTS:
            raise NotData(f"the message's tensors have more than {MAX_ELEMENTS:,} elements in all "
                          "(wire.MAX_ELEMENTS, counting a tensor the message refers to several times each time), "
                          "the most the judge reads")
        return tensor


_KEY, _ITEM = object(), object()  # a path's step into a dict's key or a set's item


def _path(at: tuple) -> str:
    """``value['x'][3]`` from :class:`_Walk`'s linked pairs ``((("value",), 'x'), 3)``."""
    steps = []
    while len(at) == 2:
        at, key = at
        steps.append(" key" if key is _KEY else " item" if key is _ITEM else f"[{_short(key)}]")
    return at[0] + "".join(reversed(steps))


def _short(key: Any) -> str:
    """A key as a path shows it: a dict's key may be a tuple of a million parts, too long to spell out."""
    text = repr(key) if type(key) in (str, int, float, bool) or key is None else type(key).__name__
    return text if len(text) <= 80 else text[:77] + "..."


_TUPLE_OPS = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}


def _refuse_shared_tuples(data: bytes) -> None:
    """Before anything is built: refuse a pickle that refers to one tuple twice. A tuple's hash is not cached, so a
    dict key or set item made of tuples that share their parts costs ``torch.load`` itself 2^levels to hash, in C,
    where no limit of the judge can interrupt it. :func:`normalise` builds every container afresh, so an honest
    message never refers to a tuple twice (strings and classes, which it does share, are not tuples)."""
    import pickletools
    import zipfile

    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            name = next((n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)
            pickled = archive.read(name) if name is not None else b""
    except (zipfile.BadZipFile, OSError, ValueError):
        return  # not torch.save's archive: torch.load refuses it
    tuples: set = set()
    previous = ""
    try:
        for opcode, argument, _ in pickletools.genops(pickled):
            if opcode.name in _PUT_OPS and previous in _TUPLE_OPS:
                tuples.add(argument)
            elif opcode.name in _GET_OPS and argument in tuples:
                raise NotData("the message refers to one tuple more than once, which normalise() never sends (a "
                              "dict key or set item of shared tuples costs 2^levels to read)")
            previous = opcode.name
    except ValueError:
        return  # a malformed pickle: torch.load refuses it


def decode(data: bytes) -> Any:
    """In the judge: the value of :func:`encode`'s bytes, read without running any code they carry, and only
    within :data:`MAX_BYTES` and the structure limits (:class:`NotData` naming the one a message exceeds)."""
    import torch

    if len(data) > MAX_BYTES:
        raise NotData(f"a worker sent {len(data)} bytes; at most {MAX_BYTES} are read")
    # Reading a message makes many containers; the collector's passes over them, which grow with the message,
    # were half of the walk's time. It is off while a message is read (the next collection frees any cycle a
    # hostile message made).
    _refuse_shared_tuples(data)
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _Walk().value(torch.load(io.BytesIO(data), weights_only=True, map_location="cpu"), 0, ("value",))
    finally:
        if collecting:
            gc.enable()


def field(report: dict, name: str, kind: type, default: Any = None) -> Any:
    """A report's field, if it has the expected JSON type; ``default`` otherwise (a report is untrusted)."""
    value = report.get(name, default)
    if kind is int and isinstance(value, bool):
        return default
    return value if isinstance(value, kind) else default

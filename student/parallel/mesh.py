# Your work goes in this file. Generated from the kit's reference by `make student`.
"""The 4D device mesh: which ranks talk to which (handout 06 §1).

Eight ranks trained as dp × tp × pp × ep = 2 × 2 × 2 × 1 are arranged in a grid of shape
``(pp, dp, ep, tp)``: rank = ((pp_index · dp + dp_index) · ep + ep_index) · tp + tp_index. Tensor
parallelism is the innermost axis, so a tensor-parallel group is a run of consecutive ranks — on a real
cluster, the GPUs of one node, joined by the fastest links (NVLink), because TP communicates inside
every layer. Pipeline parallelism is outermost: it only sends one activation per micro-batch between
neighbouring stages and tolerates the slowest links.

Each axis is a family of process groups: the ``tp`` group of a rank is the ranks that differ from it only
in the tp coordinate, and so on. Dense weights (attention, norms, embeddings, router) are replicated on
every dp *and* ep rank, so their gradients are averaged over the flattened dp × ep group; expert weights
are different on each ep rank and are averaged over dp alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kit.validate import choice, positive_int

#: Mesh dimension names, outermost first. Tensor parallel is innermost (consecutive ranks).
MESH_DIMS = ("pp", "dp", "ep", "tp")


def _check_degrees(dp: int, tp: int, pp: int, ep: int) -> None:
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)):
        positive_int(name, value)  # the size of that mesh axis


def rank_grid(*, dp: int, tp: int, pp: int, ep: int) -> torch.Tensor:
    """The global rank at every mesh coordinate: an int64 tensor of shape ``(pp, dp, ep, tp)``.

    ``rank_grid(...)[p, d, e, t]`` is the rank with pipeline stage ``p``, data-parallel index ``d``,
    expert-parallel index ``e`` and tensor-parallel index ``t``. Needs no process group.
    """
    _check_degrees(dp, tp, pp, ep)
    raise NotImplementedError("rank_grid: number the ranks row-major over (pp, dp, ep, tp) so tp is innermost (handout 06 §1)")


def build_mesh(*, dp: int, tp: int, pp: int, ep: int, device_type: str = "cpu") -> DeviceMesh:
    """A :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(pp, dp, ep, tp)`` over all ranks.

    Dims are named :data:`MESH_DIMS`; ``mesh.get_group("tp")`` is this rank's tensor-parallel group.
    Call on every rank after ``torch.distributed`` is initialised. ``device_type`` is ``"cpu"`` (gloo)
    or ``"cuda"`` (NCCL).

    Raises:
        ValueError: an axis is < 1, or dp·tp·pp·ep is not the world size.
        RuntimeError: the default process group is not initialised.
    """
    _check_degrees(dp, tp, pp, ep)
    choice("device_type", device_type, ("cpu", "cuda"))
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed to be initialised (run under torchrun or run_on_ranks)")
    world = dist.get_world_size()
    if dp * tp * pp * ep != world:
        raise ValueError(
            f"dp·tp·pp·ep = {dp}·{tp}·{pp}·{ep} = {dp * tp * pp * ep} must equal the world size {world}"
        )
    raise NotImplementedError("build_mesh: init_device_mesh over (pp, dp, ep, tp), dims named MESH_DIMS (handout 06 §1)")


def dense_grad_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group over which *dense* (replicated) gradients are averaged: the dp × ep ranks.

    Ranks in one group share their pp and tp coordinates and differ in dp and/or ep. Its size is dp·ep;
    its group ranks follow (dp, ep) row-major, as in :func:`rank_grid`. Creating process groups is
    collective — every rank creates every group, in the same order — so the first call for a mesh must
    happen on every rank; later calls return the same group (``train_step`` asks for it every step).

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh with the dims of :func:`build_mesh`.
    """
    if not isinstance(mesh, DeviceMesh) or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise TypeError(f"mesh must be a DeviceMesh with dims {MESH_DIMS} (from build_mesh), got {mesh!r}")
    group = getattr(mesh, "_dense_grad_group", None)  # one per mesh: remembered on the mesh object
    if group is None:
        raise NotImplementedError("dense_grad_group: on every rank, one new group per (pp, tp) coordinate over its dp × ep ranks (handout 06 §1)")
        mesh._dense_grad_group = group
    return group


def format_mesh(*, dp: int, tp: int, pp: int, ep: int) -> str:
    """The rank layout as text: one grid per pipeline stage, rows ``(dp, ep)``, columns ``tp``.

    Example for dp=2, tp=2, pp=2, ep=1::

        pp=0          tp=0 tp=1
          dp=0 ep=0      0    1
          dp=1 ep=0      2    3
        pp=1          tp=0 tp=1
          dp=0 ep=0      4    5
          dp=1 ep=0      6    7
    """
    grid = rank_grid(dp=dp, tp=tp, pp=pp, ep=ep)
    width = max(4, len(str(grid.numel() - 1)))
    lines = []
    for p in range(pp):
        lines.append(f"pp={p}".ljust(14) + " ".join(f"tp={t}".rjust(width) for t in range(tp)))
        for d in range(dp):
            for e in range(ep):
                cells = " ".join(str(int(grid[p, d, e, t])).rjust(width) for t in range(tp))
                lines.append(f"  dp={d} ep={e}".ljust(14) + cells)
    return "\n".join(lines)

"""The device mesh: which ranks talk to which (handout 06 §1, and 06b §6 for the fifth axis, cp).

Eight ranks trained as dp × tp × pp × ep × cp = 2 × 2 × 2 × 1 × 1 are arranged in a grid of shape
``(pp, dp, ep, cp, tp)``: rank = (((pp_index · dp + dp_index) · ep + ep_index) · cp + cp_index) · tp + tp_index.
Tensor parallelism is the innermost axis, so a tensor-parallel group is a run of consecutive ranks — on a
real cluster, the GPUs of one node, joined by the fastest links (NVLink), because TP communicates inside
every layer. Pipeline parallelism is outermost: it only sends one activation per micro-batch between
neighbouring stages and tolerates the slowest links.

Context parallelism (``cp``, handout 06b) sits just outside tp: each cp rank holds a shard of the sequence,
and the ring attention passes key/value blocks around the cp group in every attention layer — less often than
tp, which communicates in every linear layer, but far more than dp, which communicates once per step. So a cp
group should be the next-fastest links: the rest of the node once tp has its GPUs (tp · cp ≤ 8 on one node),
or the neighbouring nodes of the ring.

Each axis is a family of process groups: the ``tp`` group of a rank is the ranks that differ from it only
in the tp coordinate, and so on. Dense weights (attention, norms, embeddings, router) are replicated on
every dp, ep *and* cp rank, and each of those ranks sees different tokens (another batch shard, or another
shard of the same sequences), so their gradients are averaged over the flattened dp × ep × cp group.
Expert weights are different on each ep rank (and the all-to-all already brought every ep rank's tokens to
them) but replicated across dp and cp, so they are averaged over dp × cp.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kit.validate import choice, positive_int

#: Mesh dimension names, outermost first. Tensor parallel is innermost (consecutive ranks), cp just outside it.
MESH_DIMS = ("pp", "dp", "ep", "cp", "tp")


def _check_degrees(dp: int, tp: int, pp: int, ep: int, cp: int) -> None:
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        positive_int(name, value)  # the size of that mesh axis


def rank_grid(*, dp: int, tp: int, pp: int, ep: int, cp: int = 1) -> torch.Tensor:
    """The global rank at every mesh coordinate: an int64 tensor of shape ``(pp, dp, ep, cp, tp)``.

    ``rank_grid(...)[p, d, e, c, t]`` is the rank with pipeline stage ``p``, data-parallel index ``d``,
    expert-parallel index ``e``, context-parallel index ``c`` and tensor-parallel index ``t``. Needs no
    process group.
    """
    _check_degrees(dp, tp, pp, ep, cp)
    # BEGIN SOLUTION number the ranks row-major over (pp, dp, ep, cp, tp): tp innermost, cp next (handout 06b §6)
    return torch.arange(pp * dp * ep * cp * tp).view(pp, dp, ep, cp, tp)
    # END SOLUTION


def build_mesh(*, dp: int, tp: int, pp: int, ep: int, cp: int = 1, device_type: str = "cpu") -> DeviceMesh:
    """A :class:`~torch.distributed.device_mesh.DeviceMesh` of shape ``(pp, dp, ep, cp, tp)`` over all ranks.

    Dims are named :data:`MESH_DIMS`; ``mesh.get_group("tp")`` is this rank's tensor-parallel group,
    ``mesh.get_group("cp")`` its ring. Call on every rank after ``torch.distributed`` is initialised.
    ``device_type`` is ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).

    Raises:
        ValueError: an axis is < 1, or dp·tp·pp·ep·cp is not the world size.
        RuntimeError: the default process group is not initialised.
    """
    _check_degrees(dp, tp, pp, ep, cp)
    choice("device_type", device_type, ("cpu", "cuda"))
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed to be initialised (run under torchrun or run_on_ranks)")
    world = dist.get_world_size()
    if dp * tp * pp * ep * cp != world:
        raise ValueError(
            f"dp·tp·pp·ep·cp = {dp}·{tp}·{pp}·{ep}·{cp} = {dp * tp * pp * ep * cp} must equal the world size {world}"
        )
    # BEGIN SOLUTION init_device_mesh over (pp, dp, ep, cp, tp), dims named MESH_DIMS (handout 06b §6)
    return init_device_mesh(device_type, (pp, dp, ep, cp, tp), mesh_dim_names=MESH_DIMS)
    # END SOLUTION


def _check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh) or tuple(mesh.mesh_dim_names or ()) != MESH_DIMS:
        raise TypeError(f"mesh must be a DeviceMesh with dims {MESH_DIMS} (from build_mesh), got {mesh!r}")


def dense_grad_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group over which *dense* (replicated) gradients are averaged: the dp × ep × cp ranks.

    Ranks in one group share their pp and tp coordinates and differ in dp, ep and/or cp. Its size is
    dp·ep·cp; its group ranks follow (dp, ep, cp) row-major, as in :func:`rank_grid`. Creating process
    groups is collective — every rank creates every group, in the same order — so the first call for a
    mesh must happen on every rank; later calls return the same group (``train_step`` asks for it every
    step).

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh with the dims of :func:`build_mesh`.
    """
    _check_mesh(mesh)
    group = getattr(mesh, "_dense_grad_group", None)  # one per mesh: remembered on the mesh object
    if group is None:
        # BEGIN SOLUTION on every rank, one group per (pp, tp) coordinate over its dp × ep × cp ranks (handout 06b §6)
        grid = mesh.mesh  # the global ranks, shape (pp, dp, ep, cp, tp)
        ranks = [grid[p, :, :, :, t].flatten().tolist() for p in range(grid.shape[0]) for t in range(grid.shape[4])]
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        # END SOLUTION
        mesh._dense_grad_group = group
    return group


def expert_grad_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group over which *expert* gradients are averaged: the dp × cp ranks.

    An expert lives on one ep rank, so ep is not in the group (its all-to-all backward already summed the
    gradient of every ep rank's tokens); the dp and cp ranks that hold the same experts see different tokens.
    Ranks in one group share their pp, ep and tp coordinates; group ranks follow (dp, cp) row-major. With
    ``cp = 1`` its members are those of ``mesh.get_group("dp")``. Collective on first call, like
    :func:`dense_grad_group`.

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh with the dims of :func:`build_mesh`.
    """
    _check_mesh(mesh)
    group = getattr(mesh, "_expert_grad_group", None)
    if group is None:
        # BEGIN SOLUTION on every rank, one group per (pp, ep, tp) coordinate over its dp × cp ranks (handout 06b §6)
        grid = mesh.mesh  # (pp, dp, ep, cp, tp)
        pp, _, ep, _, tp = grid.shape
        ranks = [grid[p, :, e, :, t].flatten().tolist() for p in range(pp) for e in range(ep) for t in range(tp)]
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        # END SOLUTION
        mesh._expert_grad_group = group
    return group


def format_mesh(*, dp: int, tp: int, pp: int, ep: int, cp: int = 1) -> str:
    """The rank layout as text: one grid per pipeline stage, rows ``(dp, ep, cp)``, columns ``tp``.

    Example for dp=2, tp=2, pp=2, ep=1 (cp=1 leaves the ``cp=`` label out of the rows)::

        pp=0          tp=0 tp=1
          dp=0 ep=0      0    1
          dp=1 ep=0      2    3
        pp=1          tp=0 tp=1
          dp=0 ep=0      4    5
          dp=1 ep=0      6    7

    and for dp=2, tp=2, pp=1, ep=1, cp=2::

        pp=0               tp=0 tp=1
          dp=0 ep=0 cp=0      0    1
          dp=0 ep=0 cp=1      2    3
          dp=1 ep=0 cp=0      4    5
          dp=1 ep=0 cp=1      6    7
    """
    grid = rank_grid(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp)
    width = max(4, len(str(grid.numel() - 1)))
    label = 19 if cp > 1 else 14
    lines = []
    for p in range(pp):
        lines.append(f"pp={p}".ljust(label) + " ".join(f"tp={t}".rjust(width) for t in range(tp)))
        for d in range(dp):
            for e in range(ep):
                for c in range(cp):
                    cells = " ".join(str(int(grid[p, d, e, c, t])).rjust(width) for t in range(tp))
                    row = f"  dp={d} ep={e}" + (f" cp={c}" if cp > 1 else "")
                    lines.append(row.ljust(label) + cells)
    return "\n".join(lines)

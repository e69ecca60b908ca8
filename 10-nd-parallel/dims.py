"""The composed layout beside chapter 10's script, in one object: one grid of ranks, from which its
sizes, this rank's coordinates and every mesh and group each parallelism uses are read, as
torchtitan's ParallelDims and picotron's process-group manager read theirs.

The grid lays the ranks out (pp, replicate, shard, cp, tp), pp outermost and tp innermost, as
torchtitan lays them out: tp groups are consecutive ranks (a node's GPUs, on NVLink: TP waits for
its collectives in every block), then cp (the ring's keys and values beside attention), then the
dp ranks (FSDP's gathers, hidden behind compute; HSDP's replicas outermost of them), and pp across
nodes (only activations cross a stage's boundary). The dp ranks are replicate x shard: HSDP's
replicas of the weights, and in each the ranks that shard them (--shard-size; all dp ranks by
default: FSDP). The chapters' own checks (ring.py, pipeline.py, tp.py, experts.py) each know one
dimension; these know them together.

A mixture of experts regroups the same grid, as torchtitan's does: in each stage, the ranks that
shard or split the dense weights (shard x cp x tp) regrouped as efsdp x ep, ep innermost. The
experts are not split over tp (torchtitan dropped expert TP: each expert's matmuls would be tp
times skinnier, the tokens all-to-all'd tp times); the tp ranks' tokens (sequence parallel's) go
to the experts' ranks instead, each rank its own.
"""

import pipeline
import ring
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


class ParallelDims:
    """The layout of --pp-size, --shard-size, --cp-size, --tp-size and --ep-size over the job's
    ranks, refused in one line, before anything is built, where the ranks, the rows or the tokens
    cannot be laid out so; this rank's place in it; and, once build_meshes() has run, its meshes
    and groups, every one read from the grid:

        mesh          (pp, replicate, shard, tp): the weights'. Its shard dimension is the grid's
                      shard x cp, the ranks that hold the same weights (chapter 07's): FSDP shards
                      over it, HSDP replicates over replicate, TP splits over tp, the stages over pp
        fsdp_mesh     FSDP's part of it: (replicate, shard), or (shard) without HSDP
        cp_mesh       the ring's: the ranks that differ in cp alone
        expert_mesh   for a mixture of experts, (pp, replicate, efsdp, ep)
        stage_group   with stages and experts, the ranks of this rank's stage
    """

    def __init__(self, args, world_size: int, rank: int):
        check_sizes(args, world_size)
        self.pp, self.cp, self.tp, self.ep = args.pp_size, args.cp_size, args.tp_size, args.ep_size
        self.dp = world_size // (self.pp * self.cp * self.tp)  # the ranks that train other rows
        self.shard = args.shard_size or self.dp
        self.replicate = self.dp // self.shard
        # Its views, each a mesh's or groups' ranks, taken now: before the model (which some tools
        # build in fake tensors, where these would be fake too).
        shape = (self.pp, self.replicate, self.shard, self.cp, self.tp)
        self.grid = torch.arange(world_size).view(shape)
        self.weight_ranks = self.grid.flatten(2, 3)  # (pp, replicate, shard x cp, tp)
        # The ring's groups: the ranks that differ in cp alone.
        self.cp_groups = self.grid.movedim(3, -1).reshape(-1, self.cp).tolist()
        # Each stage's shard x cp x tp ranks as (efsdp, ep).
        self.expert_ranks = self.grid.reshape(self.pp, self.replicate, -1, self.ep)
        self.stage_ranks = self.grid.reshape(self.pp, -1).tolist()
        coordinates = (self.grid == rank).nonzero()[0].tolist()
        self.pp_rank, replicate_rank, shard_rank, self.cp_rank, self.tp_rank = coordinates
        self.dp_rank = replicate_rank * self.shard + shard_rank
        self.device = self.mesh = self.fsdp_mesh = self.cp_mesh = None  # build_meshes()'s
        self.expert_mesh = self.stage_group = None

    def build_meshes(self, device: torch.device, experts: bool) -> None:
        """Every rank calls this (it makes the process groups): the weights' mesh over the grid, the
        ring's cp groups, made on their own (a mesh with a cp dimension would make its pp, dp and tp
        groups again), and for a mixture of experts (`experts`) the experts' mesh and each stage's
        group (the experts' load is summed over the ranks that hold the same layers). `device`: the
        one this rank computes on, which the step and evaluation move their rows to."""
        self.device, device_type = device, device.type
        names = ("pp", "replicate", "shard", "tp")
        self.mesh = DeviceMesh(device_type, self.weight_ranks, mesh_dim_names=names)
        hsdp = self.replicate > 1
        self.fsdp_mesh = self.mesh["replicate", "shard"] if hsdp else self.mesh["shard"]
        cp_group, _ = dist.new_subgroups_by_enumeration(self.cp_groups)
        self.cp_mesh = DeviceMesh.from_group(cp_group, device_type, mesh_dim_names=("cp",))
        if not experts:
            return
        # In each stage, shard x cp x tp as efsdp x ep: consecutive ranks, a node's GPUs, make an ep
        # group, so that the all-to-alls of every block cross NVLink, not the network.
        names = ("pp", "replicate", "efsdp", "ep")
        self.expert_mesh = DeviceMesh(device_type, self.expert_ranks, mesh_dim_names=names)
        if self.pp > 1:
            self.stage_group = dist.new_subgroups_by_enumeration(self.stage_ranks)[0]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """FSDP's part of the experts' mesh: (replicate, efsdp), or (efsdp) without HSDP; None for a
        dense model."""
        if self.expert_mesh is None:
            return None
        hsdp = self.replicate > 1
        return self.expert_mesh["replicate", "efsdp"] if hsdp else self.expert_mesh["efsdp"]

    def __str__(self) -> str:
        hsdp = f" (replicate {self.replicate} x shard {self.shard})" if self.replicate > 1 else ""
        return f"pp {self.pp} x dp {self.dp}{hsdp} x cp {self.cp} x tp {self.tp}, ep {self.ep}"


def check_sizes(args, world_size: int) -> None:
    """Refuses, in one line and before anything is built, sizes the ranks, the rows or the tokens
    cannot be laid out by: the chapters' own checks of each dimension (ring.py, pipeline.py), and
    these of the dimensions together."""
    product = args.pp_size * args.cp_size * args.tp_size
    if world_size % product:
        sizes = {"--pp-size": args.pp_size, "--cp-size": args.cp_size, "--tp-size": args.tp_size}
        named = " x ".join(f"{flag} {size}" for flag, size in sizes.items() if size > 1)
        named += f" = {product}" if " x " in named else ""
        raise SystemExit(
            f"error: {named} must divide the number of ranks ({world_size}): each dp rank's rows "
            "are trained by that many ranks together"
        )
    dp_size = world_size // product
    if args.shard_size and dp_size % args.shard_size:
        raise SystemExit(
            f"error: --shard-size {args.shard_size} must divide the {dp_size} dp ranks (the ranks "
            "over --pp-size x --cp-size x --tp-size)"
        )
    if args.cp_size > 1:
        ring.check_layout(args, world_size, (args.shard_size or dp_size) * args.cp_size)
    if args.seq_length // args.cp_size % args.tp_size:
        tokens = args.seq_length // args.cp_size
        raise SystemExit(
            f"error: --tp-size {args.tp_size} must divide each cp rank's {tokens} tokens of a row "
            "(--seq-length / --cp-size): sequence parallel splits them"
        )
    pipeline.check_layout(args, world_size, args.shard_size or dp_size)  # the micro-batches
    stage_ranks = (args.shard_size or dp_size) * args.cp_size * args.tp_size
    if stage_ranks % args.ep_size:
        divisors = [d for d in range(1, stage_ranks + 1) if stage_ranks % d == 0]
        raise SystemExit(
            f"error: --ep-size {args.ep_size} must divide the {stage_ranks} ranks that shard or "
            "split a stage's weights (--shard-size x --cp-size x --tp-size): pass one of "
            f"{', '.join(map(str, divisors))}"
        )

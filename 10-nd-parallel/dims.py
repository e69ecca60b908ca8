"""The composed layout beside chapter 10's script: its sizes checked, its meshes built, and what a
pipeline stage sends when its layers are split over tp and its rows' tokens over cp.

The ranks are laid out (pp, dp, cp, tp), pp outermost and tp innermost, as torchtitan's ParallelDims
lays them out: tp groups are consecutive ranks (a node's GPUs, on NVLink: TP waits for its
collectives in every block), then cp (the ring's keys and values beside attention), then the dp
ranks (FSDP's gathers, hidden behind compute; HSDP's replicas outermost of them), and pp across
nodes (only activations cross a stage's boundary). The chapters' own checks (tp.py, ring.py,
pipeline.py) each know one dimension; these know them together.
"""

import pipeline
import ring
import torch
import torch.distributed as dist
import tp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard


def check_layout(args, world_size: int) -> None:
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


def check_model(model, blocks, args) -> None:
    """Refuses, in one line, a model the ring or the stages cannot take (ring.py, pipeline.py), and
    has its attention run by the ring: set before the stages' modules copy its config."""
    ring.check_model(model, args)
    if args.pp_size > 1:
        pipeline.check_model(model, blocks, args)


def build_meshes(device_type: str, args, world_size: int) -> tuple[DeviceMesh, DeviceMesh]:
    """Every rank calls this (it makes the process groups). The mesh of the weights: (pp,
    replicate, shard, tp), where shard is the dp ranks that shard each tensor and the cp ranks
    beside them, which hold the same weights (chapter 07): FSDP shards over dp_shard x cp, HSDP
    replicates over the rest of dp, TP splits over tp, stages over pp. And the cp mesh, the ring's:
    groups of the ranks that differ in cp alone, made on their own (a second init_device_mesh would
    make its pp, dp and tp groups again)."""
    dp_size = world_size // (args.pp_size * args.cp_size * args.tp_size)
    shard_size = args.shard_size or dp_size
    tp.check_layout(args, world_size, shard_size)  # its warning: a tp group across nodes
    shape = (args.pp_size, dp_size // shard_size, shard_size * args.cp_size, args.tp_size)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=("pp", "replicate", "shard", "tp"))
    layout = torch.arange(world_size).view(-1, args.cp_size, args.tp_size).transpose(1, 2)
    cp_group, _ = dist.new_subgroups_by_enumeration(layout.reshape(-1, args.cp_size).tolist())
    return mesh, DeviceMesh.from_group(cp_group, device_type, mesh_dim_names=("cp",))


def stage_boundaries(stage_module, tp_mesh: DeviceMesh) -> None:
    """A stage's inputs and outputs as PipelineStage sends them, plain tensors, under TP: the
    hidden states this rank holds of the tokens (sequence parallel: 1/tp of them) leave as they
    are and arrive as the DTensor that chapter 05's blocks take (whose shape HF reads as the whole
    row's); the logits leave as this rank's part of the vocabulary (loss_parallel's)."""
    forward = stage_module.forward

    def forward_on_plain_tensors(inputs, **kwargs):
        if inputs.is_floating_point():  # the hidden states, from the stage before
            inputs = DTensor.from_local(inputs, tp_mesh, [Shard(1)], run_check=False)
        output = forward(inputs, **kwargs)
        return output.to_local() if isinstance(output, DTensor) else output

    stage_module.forward = forward_on_plain_tensors


def stage_shapes(args, config, dtype, stage: int, num_stages: int, tp_rank: int) -> dict:
    """The stage's input and output per micro-batch, on this rank, given to PipelineStage so that
    it need not find them by running a first micro-batch: a pipeline's rows (--pp-size x
    --batch-size, chapter 08's) cut into micro-batches, each row's tokens cut over cp, the hidden
    states over tp (sequence parallel), the logits' vocabulary over tp (unevenly: torch.chunk's)."""
    rows = args.pp_size * args.batch_size // pipeline.microbatch_count(args)
    tokens = args.seq_length // args.cp_size
    vocab = len(torch.arange(config.vocab_size).chunk(args.tp_size)[tp_rank])
    with torch.device("meta"):  # the hidden states need gradients: the stages send those back
        hidden = torch.empty(rows, tokens // args.tp_size, config.hidden_size, dtype=dtype)
        hidden.requires_grad_()
        ids = torch.empty(rows, tokens, dtype=torch.long)
        logits = torch.empty(rows, tokens, vocab, dtype=dtype, requires_grad=True)
    last = stage == num_stages - 1
    return {"input_args": ids if stage == 0 else hidden, "output_args": logits if last else hidden}

"""The composed layout beside chapter 10's script: its sizes checked, its meshes built, and what a
pipeline stage sends when its layers are split over tp and its rows' tokens over cp.

The ranks are laid out (pp, dp, cp, tp), pp outermost and tp innermost, as torchtitan's ParallelDims
lays them out: tp groups are consecutive ranks (a node's GPUs, on NVLink: TP waits for its
collectives in every block), then cp (the ring's keys and values beside attention), then the dp
ranks (FSDP's gathers, hidden behind compute; HSDP's replicas outermost of them), and pp across
nodes (only activations cross a stage's boundary). The chapters' own checks (tp.py, ring.py,
pipeline.py, experts.py) each know one dimension; these know them together.

A mixture of experts (chapter 09's experts.py) takes a second mesh over the same ranks, as
torchtitan's does: in each stage, the ranks that shard or split the dense weights (dp_shard x cp x
tp) regrouped into efsdp x ep, ep innermost. The experts are not split over tp (torchtitan dropped
expert TP: each expert's matmuls would be tp times skinnier, the tokens all-to-all'd tp times);
the tp ranks' tokens (sequence parallel's) go to the experts' ranks instead, each rank its own.
"""

import logging

import common
import experts
import pipeline
import ring
import torch
import torch.distributed as dist
import tp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

logger = logging.getLogger(__name__)


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
    stage_ranks = (args.shard_size or dp_size) * args.cp_size * args.tp_size
    if stage_ranks % args.ep_size:
        divisors = [d for d in range(1, stage_ranks + 1) if stage_ranks % d == 0]
        raise SystemExit(
            f"error: --ep-size {args.ep_size} must divide the {stage_ranks} ranks that shard or "
            "split a stage's weights (--shard-size x --cp-size x --tp-size): pass one of "
            f"{', '.join(map(str, divisors))}"
        )


def check_model(model, blocks, args) -> None:
    """Refuses, in one line, a model the ring or the stages cannot take (ring.py, pipeline.py), and
    has its attention run by the ring: set before the stages' modules copy its config."""
    ring.check_model(model, args)
    if args.pp_size > 1:
        pipeline.check_model(model, blocks, args)


def check_experts(model, args, dtype) -> list:
    """The model's experts modules, all of them (none: a dense model), refused in one line where
    chapter 09 refuses them; their load tracked, before the cut: each knows its index in the whole
    model. The routers' balancing loss is HF's, over every block's router logits of a row at once,
    which the stages, cp and tp split over ranks: a config that asks for it is refused."""
    layers = common.experts_modules(model)
    flag = f"--model-name {model.config.name_or_path!r}"
    if not layers and args.ep_size > 1:
        raise SystemExit(f"error: --ep-size {args.ep_size}: {flag} is dense; pass --ep-size 1")
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        raise SystemExit(
            f"error: {flag}'s config asks for the routers' balancing loss (output_router_logits), "
            "which HF computes over all of a row's router logits at once: this chapter cuts them "
            "over ranks; set it false in config.json (its routing biases: --bias-update-rate), or "
            "train with chapter 09"
        )
    if layers:
        experts.check_model(model, args, dtype)
        experts.track_load(model, layers, args.bias_update_rate)
    return layers


def build_meshes(device_type: str, args, world_size: int) -> tuple[DeviceMesh, DeviceMesh]:
    """Every rank calls this (it makes the process groups). The mesh of the weights: (pp,
    replicate, shard, tp), where shard is the dp ranks that shard each tensor and the cp ranks
    beside them, which hold the same weights (chapter 07): FSDP shards over dp_shard x cp, HSDP
    replicates over the rest of dp, TP splits over tp, stages over pp. The cp mesh, the ring's:
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


def build_expert_meshes(device_type: str, args, mesh: DeviceMesh, moe: list) -> tuple:
    """Every rank calls this (it makes the process groups): for a mixture of experts (`moe`), the
    experts' mesh, (pp, replicate, efsdp, ep) over the ranks of the weights' mesh, ep innermost
    (consecutive ranks, a node's GPUs: the all-to-alls of every block cross NVLink, not the
    network); and each stage's ranks as one group (the experts' load is summed over those that
    hold the same layers). None and None for a dense model."""
    if not moe:
        return None, None
    pp_size, replicate, shard, tp_size = mesh.shape
    shape = (pp_size, replicate, shard * tp_size // args.ep_size, args.ep_size)
    names = ("pp", "replicate", "efsdp", "ep")
    expert_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    per_stage = mesh.size() // pp_size
    stages = [list(range(stage * per_stage, (stage + 1) * per_stage)) for stage in range(pp_size)]
    stage_group = dist.new_subgroups_by_enumeration(stages)[0] if pp_size > 1 else None
    return expert_mesh, stage_group


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


def experts_tp_plan(model, block, blocks, root_plan: dict, block_plan: dict) -> dict:
    """A block's TP plan, checked (tp.py: it names every module of the block): chapter 05's for a
    dense block; for one whose MLP is a mixture of experts, attention and norms as 05's, and the
    MoE block on this rank's tokens (sequence parallel's 1/tp of them, neither gathered nor
    scattered): its router and shared experts whole on each tp rank (their gradients summed over
    tp: reduce_expert_grads), its experts on their ep ranks (apply_expert_parallel)."""
    if not common.experts_modules(block):
        tp.check_plan(model, [block, *blocks], root_plan, block_plan)  # this block's modules
        return block_plan
    plan = {name: style for name, style in block_plan.items() if not name.startswith("mlp")}
    plan["mlp"] = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),), use_local_output=False,
    )  # fmt: skip
    mlp = block.get_submodule("mlp")
    whole = {f"mlp.{n}": None for n, part in mlp.named_modules() if list(part.parameters(False))}
    tp.check_plan(model, [block, *blocks], root_plan, plan | whole)  # this block's modules
    return plan


def compilable(block, args) -> bool:
    """Whether torch.compile can take the block: not a MoE block under TP. On torch 2.13 its graphs,
    which stop at the dispatch, fail once evaluation calls them ("'Tensor' object has no attribute
    'elem'": AOT autograd's wrapper expects the AsyncCollectiveTensor that TP's collectives left in
    the hidden states it traced), and its attention compiled alone fails to find TP's group: such a
    block runs eager, said once."""
    moe_under_tp = bool(common.experts_modules(block)) and args.tp_size > 1
    if moe_under_tp and not getattr(compilable, "said", False):
        compilable.said = True
        logger.info("--compile: the blocks of experts under --tp-size run eager (dims.compilable)")
    return not moe_under_tp


def reduce_expert_grads(model, moe_layers: list, mesh: DeviceMesh, args) -> None:
    """Every rank calls this (all-reduces over tp), after backward: the gradients of a mixture of
    experts' parts that each tp rank keeps whole (router, shared experts), each from its own tokens,
    summed over tp, as DTensor sums a sequence-parallel norm's; the experts', which the tokens of
    the ep ranks summed into and FSDP averaged over efsdp (dp_shard x cp x tp / ep ranks), times tp
    / ep: both then the mean over the dp ranks, as the dense gradients are (FSDP's over dp_shard x
    cp, TP's sum over tp)."""
    experts_params = {param for layer in moe_layers for param in layer.parameters()}
    for param in experts_params:
        param.grad.mul_(args.tp_size / args.ep_size)
    if args.tp_size == 1:
        return
    parents = {module: name.rpartition(".")[0] for name, module in model.named_modules()}
    tp_group = mesh["tp"].get_group()
    for layer in moe_layers:
        for param in model.get_submodule(parents[layer]).parameters():
            if param not in experts_params:  # FSDP's shard of it: the same on every tp rank
                dist.all_reduce(param.grad.to_local(), group=tp_group)

"""Chapter 05's tensor-parallel helpers around its Llama plan (`apply_tp`): checks, and the norms other
families add. `parallelize_module` only warns of a name it cannot find, leaves a module it is not told
about unsplit, and splits a width the ranks do not divide unevenly: `check_plan` refuses all three."""

import logging
import os

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

logger = logging.getLogger(__name__)


def check_layout(args, world_size: int, shard_size: int) -> None:
    """--tp-size and --shard-size must divide the ranks; a tp group across nodes trains, but slowly."""
    if world_size % args.tp_size:
        raise SystemExit(f"error: --tp-size {args.tp_size} must divide the number of ranks ({world_size})")
    if int(os.environ["LOCAL_WORLD_SIZE"]) % args.tp_size:
        logger.warning(f"--tp-size {args.tp_size} spans nodes: every block then waits for the network")
    dp_size = world_size // args.tp_size
    if dp_size % shard_size:
        raise SystemExit(f"error: --shard-size {shard_size} must divide the number of dp ranks ({dp_size})")


def check_tp_size(tp_size: int, config, seq_length: int) -> None:
    """Each tp rank computes whole attention heads, and sequence parallel splits every row's tokens."""
    for name, value in [
        ("attention heads", config.num_attention_heads),
        ("key/value heads", getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        ("--seq-length", seq_length),
    ]:
        if value % tp_size:
            raise SystemExit(f"error: --tp-size {tp_size} must divide the model's {name} ({value})")


def norm_plan(block, config) -> dict:
    """The plan for the norms whose names and shapes vary by family, Llama's input norm among them."""
    plan = {}
    # Around attention and the MLP (OLMo 2 has no input norm, Gemma 3 two more): on 1/tp of the tokens.
    for norm in ["input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]:
        if has_module(block, norm):
            plan[norm] = SequenceParallel()
    # Of each head's queries and keys (Qwen3, Gemma 3): each rank normalizes its own heads (dim 2 of
    # their input), with the whole weight; SequenceParallel does that for any dim. Over all heads at
    # once (OLMo 2), the ranks hold slices of the normalized width: SplitNorm.
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    for norm in ["self_attn.q_norm", "self_attn.k_norm"]:
        if has_module(block, norm) and block.get_submodule(norm).weight.numel() == head_dim:
            plan[norm] = SequenceParallel(sequence_dim=2, use_local_output=True)
        elif has_module(block, norm):
            plan[norm] = SplitNorm()
    return plan


def check_plan(model, blocks, root_plan: dict, block_plan: dict, tp_mesh) -> None:
    """Refuses a plan that names a module the model lacks, a module the plan does not know, or a
    width it cannot split evenly over the tp ranks (the MLP's intermediate size, say)."""
    missing = [n for n in root_plan if not has_module(model, n)]
    missing += [n for n in block_plan if not has_module(blocks[0], n)]
    if missing:
        raise SystemExit(
            f"error: --tp-size: apply_tp's plan is for Llama-style blocks (see README); this one has no {missing}"
        )
    in_blocks = {id(m) for block in blocks for m in block.modules()}
    unknown = [n for n, m in model.named_modules() if _weighs(m) and id(m) not in in_blocks and n not in root_plan]
    unknown += [n for n, m in blocks[0].named_modules() if _weighs(m) and n not in block_plan]
    if unknown:
        raise SystemExit(f"error: --tp-size: apply_tp's plan does not know these modules of the model: {unknown}")
    # A column-wise layer splits its outputs, a row-wise one its inputs (the vocabulary's split, the
    # root's, may be uneven: DTensor's); a width they do not divide fails deep in DTensor's matmuls.
    tp_size = tp_mesh.size()
    for name, style in block_plan.items():
        dim = 0 if isinstance(style, ColwiseParallel) else 1 if isinstance(style, RowwiseParallel) else None
        width = None if dim is None else blocks[0].get_submodule(name).weight.shape[dim]
        if width and width % tp_size:
            divisors = ", ".join(str(d) for d in range(1, tp_size) if width % d == 0)
            raise SystemExit(
                f"error: --tp-size {tp_size} must divide the {width} {('outputs', 'inputs')[dim]} of "
                f"{name}, which tensor parallel splits: pass a divisor ({divisors})"
            )


class SplitNorm(ParallelStyle):
    """A norm over the last dimension of an input that the tp ranks split (the columns of q or k): its
    weight split alike, and its mean of squares over the whole width, which DTensor all-reduces."""

    # ParallelStyle's private _apply, checked on torch 2.11-2.14. If it moves: --tp-size on OLMo 2
    # (a norm over all heads' queries or keys) fails in parallelize_module: rename SplitNorm's
    # method to the one ParallelStyle then declares abstract.
    def _apply(self, module, mesh):
        def split_weight(name, module, mesh):
            for key, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(key, torch.nn.Parameter(distribute_tensor(param, mesh, [Shard(0)])))

        def split_input(module, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, [Shard(x.dim() - 1)], run_check=False) for x in inputs)

        def local_output(module, output, mesh):
            return output.to_local()

        return distribute_module(module, mesh, split_weight, split_input, local_output)


def has_module(module, name: str) -> bool:
    try:
        module.get_submodule(name)
        return True
    except AttributeError:
        return False


def _weighs(module) -> bool:
    return next(module.parameters(recurse=False), None) is not None

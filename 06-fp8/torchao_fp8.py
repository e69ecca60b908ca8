"""torchao's float8 training around chapter 06's script: what its kernels refuse, which layers it converts
(shared with tools/plan.py), its TP styles for the layers in FP8, the line that says which layers
compute in FP8, and the weights a checkpoint holds.

FP8 multiplies only matrices whose dimensions are multiples of 16, and pays off only for large enough
matmuls: casting to FP8 reads and writes every operand once more, which a small matmul does not win
back. The matmul that counts is the one each GPU runs: under TP its slice of the weight.
"""

import collections

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
# In torchao.float8's __all__, checked on torchao 0.18. If it moves: chapter 06 and tools.plan fail
# at import: use torchao's renamed filter, or keep every layer FP8 can multiply (fp8_able, as
# --fp8-layers all does).
from torchao.float8 import _auto_filter_for_recipe  # torchao's public filter, despite the underscore
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

import tp  # chapter 05's, beside this script


def fp8_able(linear) -> bool:
    """Whether FP8 can multiply by this layer's weight: both its dimensions must be multiples of 16."""
    return linear.in_features % 16 == 0 == linear.out_features % 16


# Chapter 05's plan splits these layers by input feature under TP, every other linear of a block by output.
SPLIT_BY_INPUT = ("o_proj", "down_proj")


def local_linear(linear, fqn: str, tp_size: int) -> torch.nn.Linear:
    """The matmul one GPU runs for this layer under TP: its slice of the weight (on the meta device)."""
    out_features, in_features = linear.out_features, linear.in_features
    if fqn.rpartition(".")[2] in SPLIT_BY_INPUT:
        in_features //= tp_size
    else:
        out_features //= tp_size
    return torch.nn.Linear(in_features, out_features, bias=False, device="meta")


def fp8_filter(recipe: str, tp_size: int, fast_only: bool):
    """`module_filter_fn` for torchao's conversion: an nn.Linear whose slice on each GPU FP8 can multiply,
    and with `fast_only`, large enough for FP8 to be faster than bf16 by torchao's thresholds for the
    recipe (measured on H100s): at Llama-3.1-8B's widths with --tp-size 8, tensorwise converts o, gate,
    up and down but not q, k, v, and rowwise converts none."""
    faster = _auto_filter_for_recipe(recipe, filter_fqns=[])

    def keep(module, fqn: str) -> bool:
        if type(module) is not torch.nn.Linear:
            return False
        local = local_linear(module, fqn, tp_size)
        return faster(local, fqn) if fast_only else fp8_able(local)

    return keep


def setup(args, device, use_compile: bool) -> bool:
    """torchao's FP8 for this run: refuses what its kernels cannot run here, picks the layers (emulated: all,
    no speed to lose), and returns whether to compile, with what inductor needs for FP8 switched on."""
    check(args, device)
    args.fp8_layers = args.fp8_layers or ("all" if args.fp8_emulate else "fast")
    use_compile = use_compile and not (args.fp8_emulate and device.type == "cuda")  # Triton's FP8 casts need sm89
    # Inductor may fuse an RMSNorm into a rowwise cast without rounding to bf16 between: NaNs (pytorch#150859).
    # torch._inductor.config: private, checked on torch 2.11-2.14. If it moves: chapter 06 with
    # --fp8-recipe rowwise, compiled, stops at start with AttributeError: drop the line if that
    # torch fixed pytorch#150859, else set the option's new name.
    if args.fp8_recipe == "rowwise" and use_compile:
        torch._inductor.config.emulate_precision_casts = True
    return use_compile


def check(args, device) -> None:
    """Refuses, in one line naming the flags, what torchao's FP8 kernels cannot run here."""
    # FP8 matmuls need compute capability 8.9 (Ada, Hopper) or newer. Elsewhere torchao emulates them:
    # the same FP8 rounding, multiplied in high precision, for learning and testing; no speed-up.
    if not args.fp8_emulate and not (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)):
        raise SystemExit(
            f"error: this {device.type} has no FP8 matmuls (an H100, L40S, RTX 4090 or newer has): "
            "pass --fp8-emulate to emulate them, with no speed-up"
        )
    if args.fp8_stats_every and args.tp_size > 1 and args.fp8_recipe == "tensorwise" and device.type == "cuda":
        raise SystemExit(
            "error: --fp8-stats-every measures each tensor before its cast to FP8, but with --tp-size > 1 and "
            "tensorwise scales the blocks' inputs reach their layers cast already (FP8 all-gathers): for "
            "statistics, run with --fp8-recipe rowwise or --tp-size 1"
        )
    tokens = args.batch_size * args.seq_length
    if tokens % 16:
        # The weight's gradient multiplies over the micro-batch's tokens: torch._scaled_mm's inner
        # dimension, which it takes in multiples of 16 only (the CPU's emulation checks nothing).
        raise SystemExit(
            f"error: FP8 matmuls need a multiple of 16 tokens per micro-batch: --batch-size {args.batch_size} "
            f"x --seq-length {args.seq_length} is {tokens}; change one of them"
        )
    if args.fp8_emulate and device.type == "cuda" and args.compile:
        # Inductor compiles the emulated casts to FP8 into Triton kernels, which need compute capability 8.9.
        raise SystemExit("error: --fp8-emulate on this GPU cannot be compiled (Triton casts to FP8 on "
                         "compute capability 8.9 or newer only): pass --no-compile")


def float8_styles(block_plan: dict, block) -> dict:
    """torchao's float8 twins of a TP plan's styles, with the same arguments, for the layers of `block`
    in FP8: they cast a layer's input to FP8 before all-gathering it, and the gradient of its output.
    A module's input (PrepareModuleInput) is cast only where every layer taking it whole (its colwise
    layers) is in FP8: the float8 styles refuse a plain nn.Linear."""

    def in_fp8(name):
        return tp.has_module(block, name) and isinstance(block.get_submodule(name), Float8Linear)

    twins = {}
    for name, style in block_plan.items():
        if type(style) in (ColwiseParallel, RowwiseParallel) and in_fp8(name):
            float8 = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
            # The arguments, from what the plain style keeps of them (each layout in a 1-tuple).
            twins[name] = float8(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
        elif type(style) is PrepareModuleInput:
            fed = [n for n, s in block_plan.items() if n.startswith(f"{name}.") and type(s) is ColwiseParallel]
            if all(in_fp8(n) for n in fed):
                twins[name] = PrepareFloat8ModuleInput(
                    input_layouts=style.input_layouts,
                    desired_input_layouts=style.desired_input_layouts,
                    input_kwarg_layouts=style.input_kwarg_layouts if style.with_kwargs else None,
                    desired_input_kwarg_layouts=style.desired_input_kwarg_layouts if style.with_kwargs else None,
                    use_local_output=style.use_local_output,
                )
    return twins


def fp8_summary(model, blocks, filtered: str) -> tuple[int, str]:
    """How many of the blocks' matmul layers compute in FP8 (torchao's or TE's), and a line naming those
    that do not, by why; `filtered` says why the filter left an nn.Linear out."""
    in_fp8, total, kept = 0, 0, collections.defaultdict(set)
    for block in blocks:
        for name, module in block.named_modules():
            if isinstance(module, Float8Linear) or type(module).__module__.startswith("transformer_engine"):
                in_fp8 += 1
            elif isinstance(module, torch.nn.Linear):
                kept[filtered].add(name)
            elif any(p.dim() >= 2 for p in module.parameters(recurse=False)):
                kept[f"not nn.Linear ({type(module).__name__})"].add(name)
            else:
                continue
            total += 1
    head = model.get_output_embeddings()
    kept["the output layer"].add(next(n for n, m in model.named_modules() if m is head))
    reasons = "; ".join(f"{why}: {', '.join(sorted(names))}" for why, names in kept.items())
    return in_fp8, f"{in_fp8} of the blocks' {total} matmul layers compute in FP8; in high precision: {reasons}"


def check_in_fp8(model, blocks, args) -> str:
    """The line saying which of the blocks' layers compute in FP8; refuses a run with none."""
    in_fp8, summary = fp8_summary(model, blocks, fp8_left_out(args))
    if not in_fp8:
        raise SystemExit(f"error: no layer would compute in FP8: {summary}")
    return summary


def fp8_left_out(args) -> str:
    """Why fp8_filter left an nn.Linear of the blocks out, for fp8_summary."""
    if args.fp8_layers == "fast":
        return f"too small for FP8 to be faster at --tp-size {args.tp_size} (--fp8-layers all converts them)"
    return f"dimensions not multiples of 16 at --tp-size {args.tp_size}"


# The state_dict key torch gives a module's get_extra_state() (TE's layers' FP8 metadata): torch's
# private _EXTRA_STATE_KEY_SUFFIX, checked on torch 2.11-2.14. If it moves: TE's metadata goes into
# checkpoints and exports, and a run no longer resumes the other backend's checkpoints ("Missing
# key"): match the new key.
EXTRA_STATE = "_extra_state"


def extra_state(model) -> dict:
    """TE's layers' extra state (FP8 metadata), which a Hugging Face model's state lacks."""
    return {k: v for k, v in model.state_dict().items() if k.endswith(EXTRA_STATE)}


def weights_only(model_state: dict) -> dict:
    """The model's state without TE's extra state (FP8 scaling metadata, empty with current scaling):
    a run resumes a checkpoint of either backend, and the export holds HF's weights alone.

    torchao's weights for FP8 all-gathers are wrappers (WeightWithDynamicFloat8CastTensor) around the
    fp32 weights; they are given as the weights they wrap. DCP's asynchronous save (--async-checkpoints)
    copies a tensor to CPU memory through its storage, which a wrapper has none of: it would save
    whatever the new memory held, silently (TransformerEngine#2721 is the same bug for TE's FP8 tensors)."""
    state = {}
    for name, value in model_state.items():
        # The wrapper's private _tensor, checked on torchao 0.18. If it moves: saves with FP8
        # all-gathers fail with AttributeError in weights_only: take the inner tensor that the
        # wrapper's __tensor_flatten__() names.
        if isinstance(value, DTensor) and isinstance(value.to_local(), WeightWithDynamicFloat8CastTensor):
            spec = {"shape": value.shape, "stride": value.stride(), "run_check": False}
            value = DTensor.from_local(value.to_local()._tensor, value.device_mesh, value.placements, **spec)
        elif isinstance(value, WeightWithDynamicFloat8CastTensor):
            value = value._tensor
        if not name.endswith(EXTRA_STATE):
            state[name] = value
    return state

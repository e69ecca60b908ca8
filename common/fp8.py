"""Chapter 06's FP8 helpers: which layers compute in FP8, precision statistics, and Transformer Engine
as the other backend.

**Which layers** (`fp8_filter`): FP8 multiplies only matrices whose dimensions are multiples of 16,
and pays off only for large enough matmuls: casting to FP8 reads and writes every operand once more,
which a small matmul does not win back. The matmul that counts is the one each GPU runs: under TP its
slice of the weight. `fp8_summary` says what was converted and why the rest was not.

**Precision statistics**: how much of each tensor FP8 loses, measured torch-natively. In the spirit
of Transformer Engine's precision debug tools: on the steps it is asked to, for every layer that
computes in FP8 (torchao's `Float8Linear`), for its input, its weight and the gradient of its
output, the amax and the fractions of values that
- **underflow**: non-zero, but zero once scaled and cast (too small for FP8's range at this scale);
- **saturate**: beyond FP8's largest value once scaled, clamped to it.
Each is measured with the scale the cast really uses: for a tensor split over ranks (a DTensor: a
weight sharded by FSDP and TP, an activation split by TP), from the amax of the whole tensor, reduced
over the ranks that hold its pieces, or the weight scale FSDP precomputed; per row for the rowwise
recipe (rounded to a power of 2), with the recipe's dtypes (e4m3 for inputs and weights; e5m2 for
output gradients in the tensorwise recipe). A split tensor's counts are those of the whole tensor.
Dynamic scaling maps each amax onto FP8's largest value, so with torchao's recipes nothing saturates
by construction: the number to watch is underflow, and a saturation above 0 means a wrong scale.

**Transformer Engine** (`--fp8-backend te`): its `te.Linear` in place of the blocks' linear layers,
checked for the layout it supports and for its presence first.
"""

import collections

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchao.float8 import _auto_filter_for_recipe  # torchao's public filter, despite the underscore
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

class Float8Stats:
    """`start()` before a step's forward, and `stop()` after its backward, return the statistics of that
    step. Hooks exist only between the two, and compiled code runs eagerly there (compiled graphs have
    no hooks), so steps without statistics cost nothing.

    `group`: the ranks whose activations and gradients are combined (None: all), or `reduce=False`
    for each replica's own. A split tensor is always measured whole: the fractions are the same
    whichever ranks add up their counts."""

    def __init__(
        self, model: torch.nn.Module, group: dist.ProcessGroup | None, device, reduce: bool = True, every: int = 0
    ):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
        self.group, self.device, self.reduce, self.every = group, device, reduce, every
        self.handles, self.values, self.step = [], {}, None

    def begin(self, step: int) -> None:
        """`start()`, if optimizer step number `step` is one of every `every` steps."""
        if self.every and step % self.every == 0:
            self.step = step
            self.start()

    def end(self) -> dict[str, float] | None:
        """`stop()`'s statistics with their "step", after a step that `begin` started; otherwise None."""
        step, self.step = self.step, None
        return None if step is None else {"step": step, **self.stop()}

    def start(self) -> None:
        torch.compiler.set_stance("force_eager")
        self.values = {}
        for name, module in self.layers.items():
            # The weights this step multiplies by. With FP8 all-gathers, FSDP casts each shard with the
            # scale precomputed for the whole weight.
            precomputed = getattr(_local(module.weight), "_precomputed_scale", None)
            self._measure(f"{name}/weight", module.weight, module.config.cast_config_weight, module, precomputed)
        for name, module in self.layers.items():
            # After TP's hook has laid the input out as the layer receives it (a DTensor under TP), and
            # (prepend) before TP's hook turns the output into a local piece: split tensors stay DTensors.
            self.handles.append(module.register_forward_pre_hook(self._input_hook(name)))
            self.handles.append(module.register_forward_hook(self._output_hook(name), prepend=True))

    def stop(self) -> dict[str, float]:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        torch.compiler.set_stance("default")
        keys = sorted(self.values)
        stats = torch.stack([self.values[key] for key in keys])  # one row per tensor: amax, underflow, saturated, count
        if self.reduce:
            amax, counts = stats[:, :1].contiguous(), stats[:, 1:].contiguous()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=self.group)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=self.group)
            stats = torch.cat([amax, counts], dim=1)
        metrics = {}
        for key, (amax, underflow, saturated, count) in zip(keys, stats.tolist()):
            metrics[f"fp8/{key}_amax"] = amax
            metrics[f"fp8/{key}_underflow"] = underflow / max(count, 1)
            metrics[f"fp8/{key}_saturated"] = saturated / max(count, 1)
        return metrics

    def _input_hook(self, name):
        def hook(module, args):
            self._measure(f"{name}/input", args[0], module.config.cast_config_input, module)

        return hook

    def _output_hook(self, name):
        def hook(module, args, output):
            if output.requires_grad:
                config = module.config.cast_config_grad_output
                output.register_hook(lambda grad: self._measure(f"{name}/grad_output", grad, config, module))

        return hook

    def _measure(self, key: str, tensor: torch.Tensor, cast_config, module, scale=None) -> None:
        if _is_fp8(tensor):
            raise RuntimeError(f"{key} reached its layer already in FP8: its statistics cannot be measured")
        x = tensor.detach().float()
        dtype = cast_config.target_dtype or torch.float8_e4m3fn
        if scale is None:
            # On a DTensor, the amax of the whole tensor (per row: of the whole row), reduced over the
            # ranks holding its pieces: the scale torchao's cast of that DTensor computes.
            rowwise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
            scale = tensor_to_scale(
                x,
                dtype,
                scaling_granularity=cast_config.scaling_granularity,
                axiswise_dim=-1 if rowwise else None,
                round_scales_to_power_of_2=module.config.round_scales_to_power_of_2,
            )
        scaled = x * scale
        cast = to_fp8_saturated(scaled, dtype)
        values = [
            x.abs().max(),
            ((cast == 0) & (x != 0)).sum(),
            # The amax itself may land a float32 rounding above the largest value: not saturation.
            (scaled.abs() > torch.finfo(dtype).max * (1 + 1e-6)).sum(),
        ]
        # A DTensor's max and sums are partial on each rank: reduced over its ranks, they are the whole tensor's.
        values = [v.full_tensor() if isinstance(v, DTensor) else v for v in values]
        values.append(torch.full((), float(x.numel()), device=self.device))  # torch.tensor would wait for a copy
        row = torch.stack([value.float().to(self.device) for value in values])
        if key in self.values:  # another micro-batch, or a recomputed forward: add up
            old = self.values[key]
            row = torch.cat([torch.maximum(old[:1], row[:1]), old[1:] + row[1:]])
        self.values[key] = row


def _local(tensor):
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_fp8(tensor) -> bool:
    local = _local(tensor)
    return type(local) is not torch.Tensor and not isinstance(local, torch.nn.Parameter)


def transformer_engine(args):
    """NVIDIA's Transformer Engine and its recipe, for FSDP alone: the combination TE's own FSDP2 tests
    exercise (fully_shard over TE's layers; they do not cover FSDP's mixed precision, torch.compile or
    HF models). The recipe is TE's equivalent of torchao's tensorwise, Float8CurrentScaling: one scale
    per tensor, from its amax when it is cast.

    Not TE's delayed scaling (scales from the amaxes of past steps): that history is state, which TE
    checkpoints as a pickle that it no longer loads by default, and whose size changes once training
    starts, so that DCP cannot load it in place into a fresh model.
    """
    unsupported = [
        flag
        for flag, given in [
            ("--tp-size", args.tp_size > 1),  # TE splits layers with its own tensor parallel, not DTensor's
            ("--activation-checkpointing", args.activation_checkpointing),  # HF recomputes outside te.autocast
            ("--fp8-recipe rowwise", args.fp8_recipe == "rowwise"),
            ("--fp8-emulate", args.fp8_emulate),
            ("--fp8-stats-every", args.fp8_stats_every > 0),  # they read torchao's layers
            ("--fp8-layers", args.fp8_layers is not None),  # TE converts every layer FP8 can multiply
            ("--device cpu", args.device == "cpu"),  # TE computes on CUDA GPUs only
        ]
        if given
    ]
    if unsupported:
        raise SystemExit(
            f"error: --fp8-backend te runs on FSDP alone with tensorwise scales, not with {', '.join(unsupported)}: "
            "use --fp8-backend torchao for those"
        )
    tokens = args.batch_size * args.seq_length
    if tokens % 8:  # TE multiplies in FP8 only inputs whose rows (tokens) come in multiples of 8
        raise SystemExit(
            f"error: --fp8-backend te needs a multiple of 8 tokens per micro-batch for its FP8 matmuls: "
            f"--batch-size {args.batch_size} x --seq-length {args.seq_length} is {tokens}; change one of them"
        )
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import Float8CurrentScaling
    except (ImportError, OSError, RuntimeError) as err:
        raise SystemExit(
            f"error: --fp8-backend te: Transformer Engine does not load ({err}); install it on a machine "
            "with CUDA, against this torch: pip install --no-build-isolation 'transformer_engine[pytorch]>=2.18'"
        ) from None
    available, reason = te.is_fp8_available(return_reason=True)
    if not available:
        raise SystemExit(f"error: --fp8-backend te: no FP8 here ({reason})")
    return te, Float8CurrentScaling()


def fp8_able(linear, fqn=None) -> bool:
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


def fp8_summary(model, blocks, filtered: str) -> tuple[int, str]:
    """How many of the blocks' matmul layers compute in FP8, and a line naming those that do not, by
    why; `filtered` says why the filter left an nn.Linear out."""
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


def fp8_left_out(args) -> str:
    """Why fp8_filter left an nn.Linear of the blocks out, for fp8_summary."""
    if args.fp8_layers == "fast":
        return f"too small for FP8 to be faster at --tp-size {args.tp_size} (--fp8-layers all converts them)"
    return f"dimensions not multiples of 16 at --tp-size {args.tp_size}"


def torchao_settings(args, device, use_compile: bool) -> bool:
    """Refuses what torchao's FP8 kernels cannot run, sets what compiling them needs and which layers
    go to FP8 (--fp8-layers), and returns whether to compile."""
    # FP8 matmuls need compute capability 8.9 (Ada, Hopper) or newer. Elsewhere torchao emulates them:
    # the same FP8 rounding, multiplied in high precision, for learning and testing; no speed-up.
    if not args.fp8_emulate and not (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)):
        raise SystemExit(
            f"error: this {device.type} has no FP8 matmuls (an H100, L40S, RTX 4090 or newer has): "
            "pass --fp8-emulate to emulate them, with no speed-up"
        )
    if args.fp8_layers is None:  # emulation has no speed to lose: every layer FP8 can multiply shows its rounding
        args.fp8_layers = "all" if args.fp8_emulate else "fast"
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
    if args.fp8_emulate and device.type == "cuda" and use_compile:
        # Inductor compiles the emulated casts to FP8 into Triton kernels, which need compute capability 8.9.
        if args.compile:
            raise SystemExit("error: --fp8-emulate on this GPU cannot be compiled (Triton casts to FP8 on "
                             "compute capability 8.9 or newer only): pass --no-compile")
        use_compile = False
    if args.fp8_recipe == "rowwise" and use_compile:
        # Inductor may fuse RMSNorm with the rowwise cast that follows it, skipping the rounding to bf16
        # between them, and the scales come out wrong (NaNs): pytorch/pytorch#150859. Round as eager does.
        torch._inductor.config.emulate_precision_casts = True
    return use_compile


def convert_to_te(blocks, te=None):
    """Transformer Engine's Linear in place of each FP8-able nn.Linear of the blocks, on the meta device
    (rank 0's weights are sent in later, as for the rest of the model)."""
    if te is None:
        import transformer_engine.pytorch as te
    for block in blocks:
        for name, linear in list(block.named_modules()):
            if isinstance(linear, torch.nn.Linear) and fp8_able(linear):
                te_linear = te.Linear(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    params_dtype=torch.float32,
                    device="meta",
                )
                parent, _, child = name.rpartition(".")
                setattr(block.get_submodule(parent), child, te_linear)


def weights_only(model_state: dict) -> dict:
    """The model's state without TE's extra state (FP8 scaling metadata, empty with current scaling):
    a run resumes a checkpoint of either backend, and the export holds HF's weights alone.

    torchao's weights for FP8 all-gathers are wrappers (WeightWithDynamicFloat8CastTensor) around the
    fp32 weights; they are given as the weights they wrap. DCP's asynchronous save (--async-checkpoints)
    copies a tensor to CPU memory through its storage, which a wrapper has none of: it would save
    whatever the new memory held, silently (TransformerEngine#2721 is the same bug for TE's FP8 tensors)."""
    state = {}
    for name, value in model_state.items():
        if isinstance(value, DTensor) and isinstance(value.to_local(), WeightWithDynamicFloat8CastTensor):
            spec = {"shape": value.shape, "stride": value.stride(), "run_check": False}
            value = DTensor.from_local(value.to_local()._tensor, value.device_mesh, value.placements, **spec)
        elif isinstance(value, WeightWithDynamicFloat8CastTensor):
            value = value._tensor
        if not name.endswith("_extra_state"):
            state[name] = value
    return state

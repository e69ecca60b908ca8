"""Chapter 06's FP8 helpers: precision statistics, and Transformer Engine as the other backend.

**Precision statistics**: how much of each tensor FP8 loses, measured torch-natively. In the spirit
of Transformer Engine's precision debug tools: on the steps it is asked to, for every layer that
computes in FP8 (torchao's `Float8Linear`), for its input, its weight and the gradient of its
output, the amax and the fractions of values that
- **underflow**: non-zero, but zero once scaled and cast (too small for FP8's range at this scale);
- **saturate**: beyond FP8's largest value once scaled, clamped to it.
The scales are those the layer's recipe computes (tensorwise: one per tensor; rowwise: one per row,
rounded to a power of 2), with the recipe's dtypes (e4m3 for inputs and weights; e5m2 for output
gradients in the tensorwise recipe). Each rank measures the pieces it holds, and the counts are
reduced over a process group. Dynamic scaling maps each amax onto FP8's largest value, so with
torchao's recipes nothing saturates by construction: the number to watch is underflow.

**Transformer Engine** (`--fp8-backend te`): its `te.Linear` in place of the blocks' linear layers,
checked for the layout it supports and for its presence first.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

_STATS = ["amax", "underflow", "saturated", "count"]


class Float8Stats:
    """`start()` before a step's forward and `stop()` after its backward return the statistics of
    that step. Hooks exist only between the two, and compiled code runs eagerly there (compiled
    graphs have no hooks), so steps without statistics cost nothing."""

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None, reduce: bool = True):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
        self.group, self.reduce = group, reduce
        self.handles, self.values = [], {}

    def start(self) -> None:
        torch.compiler.set_stance("force_eager")
        self.values = {}
        for name, module in self.layers.items():
            # prepend: before TP's own pre-hook casts or gathers the input.
            self.handles.append(module.register_forward_pre_hook(self._input_hook(name), prepend=True))
            self.handles.append(module.register_forward_hook(self._output_hook(name)))

    def stop(self) -> dict[str, float]:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        torch.compiler.set_stance("default")
        for name, module in self.layers.items():
            self._measure(f"{name}/weight", module.weight, module.config.cast_config_weight, module)
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

    def _measure(self, key: str, tensor: torch.Tensor, cast_config, module) -> None:
        if isinstance(tensor, DTensor):
            tensor = tensor.to_local()
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            # Already cast to FP8 before it reached the layer (TP's float8 all-gather): nothing to measure.
            tensor = getattr(tensor, "_tensor", None)  # FSDP's float8 all-gather wraps the weight
            if tensor is None:
                return
        x = tensor.detach().float()
        dtype = cast_config.target_dtype or torch.float8_e4m3fn
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
        row = torch.stack(
            [
                x.abs().max(),
                ((cast == 0) & (x != 0)).sum().float(),
                # The amax itself may land a float32 rounding above the largest value: not saturation.
                (scaled.abs() > torch.finfo(dtype).max * (1 + 1e-6)).sum().float(),
                torch.tensor(float(x.numel()), device=x.device),
            ]
        )
        if key in self.values:  # another micro-batch, or a recomputed forward: add up
            old = self.values[key]
            row = torch.cat([torch.maximum(old[:1], row[:1]), old[1:] + row[1:]])
        self.values[key] = row


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


def convert_to_te(blocks, te):
    """Transformer Engine's Linear in place of each FP8-able nn.Linear of the blocks, on the meta device
    (rank 0's weights are sent in later, as for the rest of the model)."""
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

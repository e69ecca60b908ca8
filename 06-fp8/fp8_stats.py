"""FP8 precision statistics (--fp8-stats-every): how much of each tensor FP8 loses, measured torch-natively.

In the spirit of Transformer Engine's precision debug tools: on the steps it is asked to, for every layer
that computes in FP8 (torchao's `Float8Linear`), for its input, its weight and the gradient of its
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
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated


class Float8Stats:
    """`start(step=...)` before a step's forward, and `stop()` after its backward, return the statistics
    of that step, if it is one of every `every` steps (none with 0). Hooks exist only between the two,
    and compiled code runs eagerly there (compiled graphs have no hooks), so steps without statistics
    cost nothing.

    `reduce`: the activations and gradients of all ranks combined, or (False) each replica's own. A
    split tensor is always measured whole: the fractions are the same whichever ranks add up their counts."""

    def __init__(self, model: torch.nn.Module, device, *, reduce: bool = True, every: int = 1):
        self.layers = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
        self.device, self.reduce, self.every = device, reduce, every
        self.handles, self.values, self.step = [], {}, None

    def start(self, *, step: int) -> None:
        """Every rank calls this: measures the weights and hooks the layers, if optimizer step
        number `step` is due."""
        if not self.every or step % self.every:
            return
        self.step = step
        torch.compiler.set_stance("force_eager")
        self.values = {}
        for name, module in self.layers.items():
            # The weights this step multiplies by. With FP8 all-gathers, FSDP casts each shard with the
            # scale precomputed for the whole weight.
            # The wrapper's private _precomputed_scale, checked on torchao 0.18. If it moves: no
            # error: --fp8-stats-every measures the weights with scales of their own, not the
            # cast's: read the attribute that the wrapper's __tensor_flatten__() now names.
            precomputed = getattr(_local(module.weight), "_precomputed_scale", None)
            self._measure(f"{name}/weight", module.weight, module.config.cast_config_weight, module, precomputed)
        for name, module in self.layers.items():
            # After TP's hook has laid the input out as the layer receives it (a DTensor under TP), and
            # (prepend) before TP's hook turns the output into a local piece: split tensors stay DTensors.
            self.handles.append(module.register_forward_pre_hook(self._input_hook(name)))
            self.handles.append(module.register_forward_hook(self._output_hook(name), prepend=True))

    def stop(self) -> dict[str, float] | None:
        """Every rank calls this: the statistics of the step `start` hooked, with its "step"; None
        after any other step."""
        step, self.step = self.step, None
        if step is None:
            return None
        for handle in self.handles:
            handle.remove()
        self.handles = []
        torch.compiler.set_stance("default")
        keys = sorted(self.values)
        stats = torch.stack([self.values[key] for key in keys])  # one row per tensor: amax, underflow, saturated, count
        if self.reduce:
            amax, counts = stats[:, :1].contiguous(), stats[:, 1:].contiguous()
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)
            stats = torch.cat([amax, counts], dim=1)
        metrics = {"step": step}
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

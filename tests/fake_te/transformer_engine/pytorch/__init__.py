"""Stand-in for transformer_engine.pytorch (see transformer_engine/__init__.py)."""

import math

import torch
import torch.nn.functional as F

_fp8_recipe = None  # the recipe of the te.autocast region being run, if any


def is_fp8_available(return_reason: bool = False):
    return (True, "") if return_reason else True


class autocast:
    def __init__(self, enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
        self.enabled, self.recipe = enabled, recipe

    def __enter__(self):
        global _fp8_recipe
        self.outer, _fp8_recipe = _fp8_recipe, (self.recipe if self.enabled else None)
        return self

    def __exit__(self, *exc):
        global _fp8_recipe
        _fp8_recipe = self.outer


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """x rounded to e4m3 with one scale per tensor; gradients pass through unchanged."""
    scale = torch.finfo(torch.float8_e4m3fn).max / x.detach().abs().amax().clamp(min=1e-12)
    rounded = (x.detach() * scale).to(torch.float8_e4m3fn).to(x.dtype) / scale
    return x + (rounded - x.detach())


class Linear(torch.nn.Module):
    def __init__(self, in_features, out_features, bias=True, params_dtype=None, device="cuda", **kwargs):
        super().__init__()
        self.in_features, self.out_features, self.use_bias = in_features, out_features, bias
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.bias = torch.Tensor().to(device=device, dtype=dtype)  # as TE: an attribute, not a parameter
        if device != "meta":
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    @torch._dynamo.disable  # TE's forward is marked no_torch_dynamo: compile breaks the graph around it
    def forward(self, inp):
        # Real TE computes in high precision outside te.autocast; chapter 06 never calls it there, so
        # the stand-in refuses: a forward (training's, evaluation's) left out of te.autocast fails.
        if _fp8_recipe is None:
            raise RuntimeError("te.Linear called outside te.autocast")
        inp, weight = _e4m3(inp), _e4m3(self.weight)
        return F.linear(inp, weight, self.bias if self.use_bias else None)

    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)  # TE >= 2.18 with a stateless recipe such as current scaling

    def set_extra_state(self, state) -> None:
        if not isinstance(state, torch.Tensor) or state.numel():
            raise RuntimeError(f"Unsupported checkpoint format: {type(state).__name__}")

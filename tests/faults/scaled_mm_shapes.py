"""Makes emulated FP8 matmuls check what the GPU's do: before each one, torch._scaled_mm runs on
meta tensors of the operands' shapes, layouts and scales, so that its own checks (both dimensions of
the second operand multiples of 16, the scales' shapes) fail on the CPU where they would on an H100.
Emulation otherwise multiplies with a plain mm, which takes any shape. Installed by probes.py
with PROBE_SCALED_MM_SHAPES=1 (the table in sitecustomize.py), or by a test in its own process."""

import torch
from torchao.float8 import float8_ops

_WRAPPED = {}


def _meta(tensor, transposed=False):
    if transposed:  # _scaled_mm takes its second operand column-major, as torchao lays it out
        return torch.empty(tensor.shape[::-1], dtype=tensor.dtype, device="meta").t()
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _checked(op):
    def check_then_run(aten_op, args, kwargs=None):
        a, b = (args[1], args[2]) if aten_op is torch.ops.aten.addmm.default else (args[0], args[1])
        torch._scaled_mm(
            _meta(a._data), _meta(b._data, transposed=True), _meta(a._scale), _meta(b._scale), out_dtype=a._orig_dtype
        )
        return op(aten_op, args, kwargs)

    return check_then_run


def install():
    for aten_op in [torch.ops.aten.mm.default, torch.ops.aten.matmul.default, torch.ops.aten.addmm.default]:
        _WRAPPED[aten_op] = float8_ops.FLOAT8_OPS_TABLE[aten_op]
        float8_ops.FLOAT8_OPS_TABLE[aten_op] = _checked(_WRAPPED[aten_op])


def uninstall():
    float8_ops.FLOAT8_OPS_TABLE.update(_WRAPPED)
    _WRAPPED.clear()

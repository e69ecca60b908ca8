"""Chapter 06's FP8: the most it can speed a step up, by torchao's roofline model."""

import torch

from tools.plan_model import Layout

# What selective checkpointing recomputes of a Llama block's matmuls
# (common/activation_checkpointing.py keeps every other one).
SELECTIVE_RECOMPUTED = {"k_proj", "o_proj", "up_proj"}


def fp8_ceiling(
    m: dict, layout: Layout, batch_size: int, seq_length: int, mfu: float, gpu="NVIDIA H100"
) -> dict:
    """What chapter 06 (tensorwise, --fp8-layers fast) can gain at most on this layout, by torchao's
    own roofline model (torchao.testing.training.roofline_utils): each converted layer's three
    matmuls (forward, and the gradients of its input and weight) on this GPU's slice, in bf16 and in
    FP8 at 78% of the datasheet's peaks or the memory traffic, whichever is longer, FP8's with the
    casts of its input, weight and output gradient (amax reductions fused into the op before, as
    compiled); with activation checkpointing, each recomputed forward again, with its input's cast.
    The time FP8 saves on them, out of a bf16 step that runs at `mfu` (the chapters' MFU: model
    FLOPs over the datasheet's peak), gives the ceiling: everything else (attention, the layers left
    in bf16, the output layer and the loss, the optimizer) is as fast as before."""
    from torchao.testing.training import roofline_utils as roofline

    e4m3, tokens = torch.float8_e4m3fn, batch_size * seq_length // layout.cp  # a GPU's micro-step
    specs = roofline.get_specs(gpu)
    times = {"bf16": 0.0, "fp8": 0.0}
    for name, (k, n) in m["fp8_shapes"].get(layout.tp, {}).items():
        selective = layout.checkpointing == "selective" and name in SELECTIVE_RECOMPUTED
        recompute = layout.checkpointing in (True, "full") or selective
        bf16 = roofline.get_gemm_time_sympy(tokens, k, n, torch.bfloat16, None, None, gpu)
        fp8 = roofline.get_gemm_time_sympy(tokens, k, n, e4m3, "tensorwise", None, gpu)
        fp8 += roofline.get_float8_mem_sympy(tokens, k, n, "tensorwise", None, True, gpu)
        if recompute:
            bf16 += roofline.get_individual_gemm_time_sympy(tokens, k, n, torch.bfloat16, None, gpu)
            fp8 += roofline.get_individual_gemm_time_sympy(tokens, k, n, e4m3, None, gpu)
            cast = roofline.get_tensor_memory_traffic_ovhd_s(
                specs, tokens, k, "input", "tensorwise", None, True
            )
            fp8 += sum(cast)
        times["bf16"] += m["layers"] * float(bf16)
        times["fp8"] += m["layers"] * float(fp8)
    per_token = 6 * m["matmul_weights"] + m["attention_flops"] * seq_length
    flops = batch_size * seq_length * per_token / layout.tp / layout.cp
    step = flops / (specs["bf16_peak_tops"] * mfu)
    return {**times, "step": step, "ceiling": step / (step - times["bf16"] + times["fp8"])}

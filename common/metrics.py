"""What a step measures besides time: memory, FLOPs and the GPUs' peaks for MFU, and the guard that
stops a run whose loss or gradient norm is no longer finite."""

import re
import resource
import sys

import psutil
import torch
from torch.distributed.tensor import DTensor

from common.model import experts_modules

_GIB = 2**30


class NonFiniteGuard:
    """Notes on the device, with no sync, the first step whose loss or gradient norm is NaN or Inf:
    `check()` reads it where the host waits anyway (log lines; before a save: none saved broken)."""

    def __init__(self, device: torch.device):
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Every rank calls this after each step: a DTensor norm is made whole by a collective."""
        if isinstance(grad_norm, DTensor):  # FSDP's norm: the same full value on every rank
            grad_norm = grad_norm.full_tensor()
        # With --cpu-offload the gradients, and so their norm, are on the CPU: a copy, not a sync.
        norm_finite = torch.isfinite(grad_norm).to(loss.device, non_blocking=True)
        finite = torch.isfinite(loss.detach()) & norm_finite
        first_bad = ~finite & (self.first_bad_step == 0)
        self.first_bad_step = torch.where(first_bad, step, self.first_bad_step)

    def check(self) -> None:
        step = int(self.first_bad_step)
        if step:
            raise SystemExit(
                f"error: the loss or gradient norm became NaN or Inf at step {step}; no checkpoint "
                "was saved after it. Lower --lr, or raise --warmup-steps, and rerun: it resumes "
                "from the last checkpoint"
            )


def memory_stats(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "memory/allocated_gib": torch.cuda.memory_allocated(device) / _GIB,
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / _GIB,
            "memory/reserved_gib": torch.cuda.memory_reserved(device) / _GIB,
        }
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * unit
    rss = psutil.Process().memory_info().rss
    return {"memory/rss_gib": rss / _GIB, "memory/peak_rss_gib": peak_rss / _GIB}


def shard_memory(model, optimizer) -> dict:
    """This rank's share of the weights (so of the gradients) and of AdamW's moments: DTensors."""
    params = sum(p.to_local().nbytes for p in model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, DTensor)]
    moments = sum(v.to_local().nbytes for v in states)
    return {"memory/params_gib": params / _GIB, "memory/optimizer_gib": moments / _GIB}


def flops_per_token(model, config, seq_length: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward) plus attention (PaLM,
    app. B). The weights are those of every linear layer (torch's, torchao's, Transformer Engine's)
    at full shape; the input embedding is a lookup, free, while a tied output head is a matmul."""
    linears = [m for m in model.modules() if hasattr(m, "out_features")]
    matmul_weights = sum(m.in_features * m.out_features for m in linears)
    # A mixture of experts' stacked experts (3-D weights, one slice per expert): each token goes
    # through num_experts_per_tok of them. (The routers' small matmul is left out.)
    stacked = [p for m in experts_modules(model) for p in m.parameters(recurse=False)]
    top_k = getattr(config, "num_experts_per_tok", 0)
    matmul_weights += sum(top_k * p.numel() // p.shape[0] for p in stacked if p.ndim == 3)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length
    return 6 * matmul_weights + attention


# Dense (not sparse) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s, by the name
# torch.cuda.get_device_name() reports, less its "NVIDIA " prefix (the H100 SXM: "H100 80GB HBM3").
# fmt: off
_PEAK_BF16_FLOPS = {
    "GB200": 2.5e15, "B200": 2.25e15, "GH200": 989e12, "H200": 989e12, "H200 NVL": 835e12,
    "H100": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "A100": 312e12, "L40S": 362e12,
    "L40": 181e12, "L4": 121e12, "A10": 125e12,
}
# fmt: on


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (then MFU is not reported)."""
    return lookup_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def lookup_peak_flops(name: str) -> float | None:
    """The longest key in `name` as whole words: "H100 PCIe" over "H100"; "L4" not in "L40S"."""
    for key in sorted(_PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", name):
            return _PEAK_BF16_FLOPS[key]
    return None

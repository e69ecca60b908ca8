"""What the chapters measure, and where it goes: log lines, phase timers, memory, FLOPs and the GPU
peaks for MFU, the non-finite guard, and the metrics (metrics.jsonl and wandb)."""

import json
import logging
import os
import re
import resource
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch
import tqdm
import wandb
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record):
        tqdm.tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(prefix: str = "", level: int = logging.INFO) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"{prefix}[%(asctime)s] %(levelname)s:%(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # transformers imports torchao, when installed, for its quantizers; torchao then warns about
    # kernels it has not built for this machine, which no chapter uses (chapter 06's float8 needs none).
    for name in ["torchao", "torch.utils._pytree"]:
        logging.getLogger(name).setLevel(logging.ERROR)


class NonFiniteGuard:
    """Watches the loss and gradient norm for NaN or Inf without a host-device sync of its own: it notes
    on the device the first step with a non-finite value, and `check()` reads that where the host
    waits anyway (at log lines, and before a save, so that a broken model never becomes a checkpoint)."""

    def __init__(self, device: torch.device):
        self.first_bad_step = torch.zeros((), dtype=torch.long, device=device)

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if isinstance(grad_norm, DTensor):  # FSDP's norm: the same full value on every rank
            grad_norm = grad_norm.full_tensor()
        # With --cpu-offload the gradients, and so their norm, are on the CPU: a copy, not a sync.
        finite = torch.isfinite(loss.detach()) & torch.isfinite(grad_norm).to(loss.device, non_blocking=True)
        self.first_bad_step = torch.where(~finite & (self.first_bad_step == 0), step, self.first_bad_step)

    def check(self) -> None:
        step = int(self.first_bad_step)
        if step:
            raise SystemExit(
                f"error: the loss or gradient norm became NaN or Inf at step {step}; no checkpoint was "
                "saved after it. Lower --lr, or raise --warmup-steps, and rerun: it resumes from the last checkpoint"
            )


class PhaseTimers:
    """Time per phase of the training step (data, forward, ...), averaged between two `summary()` calls.

    On CUDA the GPU runs behind the CPU, so wall-clock time around a phase measures the CPU queueing
    kernels, not the GPU running them. Each phase is therefore bracketed by CUDA events on the stream;
    reading them needs a sync, which happens once, in `summary()` at log time, not once per phase.
    """

    def __init__(self, device: torch.device):
        self.use_cuda_events = device.type == "cuda"
        self._events = defaultdict(list)
        self._seconds = defaultdict(list)

    @contextmanager
    def __call__(self, phase: str):
        if self.use_cuda_events:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events[phase].append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds[phase].append(time.perf_counter() - t0)

    def summary(self, steps: int) -> dict:
        """Milliseconds per step in each phase since the last call (a phase may run several times in a
        step: once per micro-batch), then starts over."""
        if self.use_cuda_events:
            torch.cuda.synchronize()
            for phase, pairs in self._events.items():
                self._seconds[phase] = [start.elapsed_time(end) / 1000 for start, end in pairs]
            self._events.clear()
        result = {f"time/{phase}_ms": 1000 * sum(s) / steps for phase, s in self._seconds.items()}
        self._seconds.clear()
        return result


def memory_stats(device: torch.device) -> dict:
    """GPU memory of this process's tensors on CUDA; the process's resident memory (RSS) on CPU."""
    gib = 2**30
    if device.type == "cuda":
        return {
            "memory/allocated_gib": torch.cuda.memory_allocated(device) / gib,
            "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / gib,
            "memory/reserved_gib": torch.cuda.memory_reserved(device) / gib,
        }
    # ru_maxrss is in KiB on Linux and in bytes on macOS.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"memory/rss_gib": psutil.Process().memory_info().rss / gib, "memory/peak_rss_gib": peak_rss / gib}


def shard_memory(model, optimizer) -> dict:
    """This rank's share of the weights and of AdamW's moments (sharded: DTensors; the gradients match
    the weights)."""
    gib = 2**30
    params = sum(p.to_local().nbytes for p in model.parameters())
    moments = sum(v.to_local().nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, DTensor))
    return {"memory/params_gib": params / gib, "memory/optimizer_gib": moments / gib}


def flops_per_token(model, config, seq_length: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward) plus attention (PaLM paper, app. B).

    The weights are those of the model's linear layers, counted by their full shape (also when
    sharded), whatever their class: torch's, torchao's FP8 ones, and Transformer Engine's, which are no
    nn.Linear. The input embedding is a lookup and costs nothing, while a tied output head shares the
    embedding's weight and still costs a full matmul.
    """
    linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    matmul_weights = sum(m.in_features * m.out_features for m in linears)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_length
    return 6 * matmul_weights + attention


# Dense (not sparse) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s, by the name
# torch.cuda.get_device_name() reports, less its "NVIDIA " prefix.
_PEAK_BF16_FLOPS = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "GH200": 989e12,
    "H200": 989e12,
    "H200 NVL": 835e12,
    "H100": 989e12,  # the SXM part reports "H100 80GB HBM3"
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10": 125e12,
}


def peak_bf16_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where it is not known (then MFU is not reported)."""
    if device.type != "cuda":
        return None
    return lookup_peak_flops(torch.cuda.get_device_name(device))


def lookup_peak_flops(name: str) -> float | None:
    """The longest entry found in `name` as whole words: "H100 PCIe" wins over "H100", and "L4"
    never matches "L40S", nor "B200" "GB200"."""
    for key in sorted(_PEAK_BF16_FLOPS, key=len, reverse=True):
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", name):
            return _PEAK_BF16_FLOPS[key]
    return None


_wandb_calls = True  # until a stop signal: see log_metrics


def stop_wandb_calls() -> None:
    """Called by common.distributed.StopSignal when a stop signal reaches this process."""
    global _wandb_calls
    _wandb_calls = False


def log_metrics(metrics: dict, jsonl: Path | None) -> None:
    """One record (with its "step") to the file `jsonl` (None: not from this rank) and to wandb.

    Slurm sends its stop signal to every process of a job, wandb's service process included: if that
    has stopped, the metrics still reach the file and training goes on to its checkpoint. Once this
    process has had a stop signal, wandb is not called at all: a service that is shutting down may
    leave the call waiting, and the checkpoint unsaved when the scheduler's grace period ends.
    """
    if jsonl is not None:
        with open(jsonl, "a") as f:
            f.write(json.dumps(metrics) + "\n")
    if not _wandb_calls:
        return
    try:
        wandb.log(metrics, step=metrics["step"])
    except (ConnectionError, BrokenPipeError):
        logger.warning("wandb's service has stopped (a stop signal?): these metrics are in metrics.jsonl only")


def wandb_mode() -> str | None:
    """`WANDB_MODE` when set; otherwise online if a W&B login exists and its server answers, else
    offline, saying why in one line (never a key prompt, never a stall on a node without network)."""
    if os.environ.get("WANDB_MODE"):
        return None  # wandb reads it itself
    if not wandb.login(prompt=False, verify=False):
        logger.info("No W&B login found: logging offline. Upload later with `wandb sync`, or `wandb login` first.")
        return "offline"
    try:
        wandb.Api(timeout=10).viewer  # one request: does the server answer?
    except Exception as err:
        logger.warning(
            f"W&B login found, but its server cannot be reached ({type(err).__name__}): logging "
            "offline. Upload later with `wandb sync`."
        )
        return "offline"
    return "online"

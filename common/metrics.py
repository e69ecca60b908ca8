"""What the chapters measure, and where it goes: log lines, phase timers and the straggler, memory, FLOPs and
GPU peaks for MFU, the non-finite guard, metrics.jsonl and wandb."""

import json
import logging
import os
import re
import resource
import socket
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import tqdm
import wandb
from torch.distributed.tensor import DTensor

logger = logging.getLogger(__name__)

SEE = 'DIAGNOSING.md, "The job is slower than it should be"'
# Below 0.8 x the median pace (as tools.preflight's --threshold) for 5 log steps in a row: one slow interval
# (a compile, a neighbour's burst on a shared CPU) is not a straggler.
STRAGGLER_THRESHOLD, STRAGGLER_LOG_STEPS = 0.8, 5


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record):
        tqdm.tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(prefix: str = "", level: int = logging.INFO) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"{prefix}[%(asctime)s] %(levelname)s:%(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


class NonFiniteGuard:
    """Notes on the device the first step whose loss or gradient norm is NaN or Inf, with no sync of its own:
    `check()` reads it where the host waits anyway (log lines; before a save: no broken model is saved)."""

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

    The GPU runs behind the CPU: wall-clock time would measure the CPU queueing kernels. So on CUDA each
    phase is bracketed by CUDA events, read with one sync in `summary()`, at log time.
    `compare_ranks`: `summary()` also names the straggler (a collective: every rank calls it at the same steps).
    `blocks`: their forward is also timed alone ("compute"), between FSDP's hooks, without its all-gathers' waits.
    """

    def __init__(self, device: torch.device, compare_ranks: bool = False, blocks=()):
        self.use_cuda_events = device.type == "cuda"
        self._spans = defaultdict(list)  # (start, end) per phase: CUDA events, or perf_counter()'s seconds
        self._block_starts = []
        self._stragglers = Stragglers(device) if compare_ranks else None
        for block in blocks:
            # After FSDP's pre-forward hook (prepended): its all-gather has arrived when this one starts.
            block.register_forward_pre_hook(self._block_start)
            block.register_forward_hook(self._block_end)

    def _now(self):
        if not self.use_cuda_events:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def __call__(self, phase: str):
        start = self._now()
        yield
        self._spans[phase].append((start, self._now()))

    # Run as FSDP's hooks are, outside a block's compiled graph (which then stays whole).
    @torch.compiler.disable
    def _block_start(self, module, args):
        self._block_starts.append(self._now())

    @torch.compiler.disable
    def _block_end(self, module, args, output):
        self._spans["compute"].append((self._block_starts.pop(), self._now()))

    def summary(self, steps: int) -> dict:
        """Milliseconds per step in each phase since the last call (a phase may run several times in a
        step: once per micro-batch), then starts over; with `compare_ranks`, the straggler's keys too."""
        if self.use_cuda_events:
            torch.cuda.synchronize()
        ms = (lambda s, e: s.elapsed_time(e)) if self.use_cuda_events else (lambda s, e: 1000 * (e - s))
        result = {f"time/{phase}_ms": sum(ms(*span) for span in spans) / steps for phase, spans in self._spans.items()}
        self._spans.clear()
        if self._stragglers is not None:
            result |= self._stragglers.report(result)
        return result


class Stragglers:
    """Names the rank that holds the others back, from every rank's timings at a log step.

    Every rank's step takes as long as the slowest's: the others wait in a collective, and the wait lands
    in one of their phases. So a rank's own work is what it does alone: loading its batch ("data") and
    computing ("compute": the blocks' forward between FSDP's collectives, else DDP's collective-free
    forward; backward has collectives under both). The straggler's data + compute is the largest. Rank 0
    warns when one rank works below STRAGGLER_THRESHOLD x the median pace for STRAGGLER_LOG_STEPS log steps.
    """

    PHASES = ("data", "forward", "backward", "optimizer", "compute")

    def __init__(self, device: torch.device):
        self.device = device
        self.hosts = [None] * dist.get_world_size()
        dist.all_gather_object(self.hosts, socket.gethostname())
        self.rank, self.streak = None, 0

    def report(self, timings: dict) -> dict:
        mine = [timings.get(f"time/{phase}_ms", 0.0) for phase in self.PHASES]
        gathered = [torch.empty(len(mine), device=self.device) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor(mine, device=self.device))  # into a list: the same in every torch
        data, forward, _, _, compute = zip(*torch.stack(gathered).tolist())
        compute = compute if any(compute) else forward  # no blocks timed: the forward is local (DDP)
        work = [d + c for d, c in zip(data, compute)]
        slowest, median = max(range(len(work)), key=work.__getitem__), statistics.median(work)
        if work[slowest] * STRAGGLER_THRESHOLD > median:
            self.streak = self.streak + 1 if slowest == self.rank else 1
        else:
            self.streak = 0
        self.rank = slowest
        if self.streak == STRAGGLER_LOG_STEPS and dist.get_rank() == 0:
            slow_data = data[slowest] - statistics.median(data) > compute[slowest] - statistics.median(compute)
            cause = (
                "a slow data path on that host: its disk or file system, too few CPU cores for its ranks, or "
                "another process on them"
                if slow_data
                else "a slow GPU: throttled (clocks, power, temperature), another process on it, or a bad "
                "PCIe link; on CPUs, another process on its cores"
            )
            logger.warning(
                f"Straggler: rank {slowest} on {self.hosts[slowest]} holds back every rank, for "
                f"{self.streak} log steps in a row: data + compute {work[slowest]:.1f} ms per step, "
                f"{work[slowest] / median:.1f}x the median rank's {median:.1f} ms (data {data[slowest]:.1f}, "
                f"compute {compute[slowest]:.1f}). Likely {cause}. See {SEE}"
            )
        return {
            "straggler/rank": slowest,
            "straggler/host": self.hosts[slowest],
            "straggler/work_ms": work[slowest],
            "straggler/median_work_ms": median,
            "straggler/slow_log_steps": self.streak,
        }


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
    """This rank's share of the weights (and so of the gradients) and of AdamW's moments: DTensors, sharded."""
    gib = 2**30
    params = sum(p.to_local().nbytes for p in model.parameters())
    moments = sum(v.to_local().nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, DTensor))
    return {"memory/params_gib": params / gib, "memory/optimizer_gib": moments / gib}


def flops_per_token(model, config, seq_length: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward) plus attention (PaLM, app. B).
    The weights are those of every linear layer (torch's, torchao's, Transformer Engine's), at full shape;
    the input embedding is a lookup, free, while a tied output head still costs a full matmul."""
    linears = [m for m in model.modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]
    matmul_weights = sum(m.in_features * m.out_features for m in linears)
    # A mixture of experts' stacked experts (3-D weights, one slice per expert): each token goes through
    # num_experts_per_tok of them. (The routers' small matmul, hidden x experts, is left out.)
    stacked = [p for m in model.modules() if hasattr(m, "num_experts") for p in m.parameters(recurse=False)]
    top_k = getattr(config, "num_experts_per_tok", 0)
    matmul_weights += sum(top_k * p.numel() // p.shape[0] for p in stacked if p.ndim == 3)
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
    """The longest entry in `name` as whole words: "H100 PCIe" over "H100"; "L4" never matches "L40S"."""
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

    Slurm's stop signal reaches wandb's service process too: if it has stopped, the metrics still reach the
    file and training goes on to its checkpoint. After a stop signal wandb is not called at all: a service
    shutting down may leave the call waiting past the scheduler's grace period, the checkpoint unsaved.
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
    """`WANDB_MODE` when set; else online if a W&B login exists and its server answers, else offline, saying
    why in one line (never a key prompt, never a stall on a node without network)."""
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

"""Helpers that every chapter uses unchanged: logging, timers, memory, FLOPs, metrics, checkpoint folders."""

import argparse
import json
import logging
import math
import os
import re
import resource
import shutil
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

logger = logging.getLogger(__name__)


class _TqdmHandler(logging.StreamHandler):
    """Writes log lines above the progress bar instead of through it."""

    def emit(self, record):
        tqdm.tqdm.write(self.format(record), file=sys.stderr)


def setup_logging(prefix: str = "", level: int = logging.INFO) -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(f"{prefix}[%(asctime)s] %(levelname)s:%(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)


@contextmanager
def rank0_first(local: bool = False):
    """Rank 0 runs the block first (downloads, tokenizes, fills the caches), then the other ranks run
    it and find everything cached. Without it, every rank would download and tokenize at once.

    With `local=True`, local rank 0 of every node goes first: for caches on each node's own disk.
    """
    first = int(os.environ["LOCAL_RANK"]) == 0 if local else dist.get_rank() == 0
    if not first:
        dist.barrier()
    yield
    if first:
        dist.barrier()


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

    def summary(self) -> dict:
        """Mean milliseconds per step for each phase since the last call, then starts over."""
        if self.use_cuda_events:
            torch.cuda.synchronize()
            for phase, pairs in self._events.items():
                self._seconds[phase] = [start.elapsed_time(end) / 1000 for start, end in pairs]
            self._events.clear()
        result = {f"time/{phase}_ms": 1000 * sum(s) / len(s) for phase, s in self._seconds.items()}
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


def flops_per_token(model, config, seq_length: int) -> float:
    """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward) plus attention (PaLM paper, app. B).

    The weights are those of the model's linear layers: the input embedding is a lookup and costs
    nothing, while a tied output head shares the embedding's weight and still costs a full matmul.
    A sharded weight (DTensor) counts its full size.
    """
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
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


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def wandb_mode() -> str | None:
    """`WANDB_MODE` when set; otherwise online if a W&B login exists, else offline (never a key prompt)."""
    if os.environ.get("WANDB_MODE"):
        return None  # wandb reads it itself
    if wandb.login(prompt=False, verify=False):
        return "online"
    logger.info("No W&B login found: logging offline. Upload later with `wandb sync`, or `wandb login` first.")
    return "offline"


_CHECKPOINT_NAME = re.compile(r"step-(\d+)")


def checkpoint_dir(exp_dir: Path, step: int) -> Path:
    return exp_dir / "checkpoints" / f"step-{step:08d}"


def latest_checkpoint(exp_dir: Path) -> Path | None:
    """The newest complete checkpoint folder. Unfinished saves (`*.tmp`) don't match and are ignored."""
    folders = [p for p in (exp_dir / "checkpoints").glob("step-*") if _CHECKPOINT_NAME.fullmatch(p.name)]
    return max(folders, key=lambda p: int(p.name.removeprefix("step-")), default=None)


def publish_checkpoint(tmp_dir: Path, final_dir: Path) -> None:
    """Makes a fully written `tmp_dir` the checkpoint `final_dir`, atomically, and drops older ones.

    Files are flushed to disk first, so that after a machine crash the renamed folder never holds
    files whose data did not reach the disk. A rename is atomic: a crash at any point leaves either
    the old checkpoints or the new one, never a partial one that resume would trust.
    """
    for path in [*tmp_dir.rglob("*"), tmp_dir]:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    os.replace(tmp_dir, final_dir)
    fd = os.open(final_dir.parent, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    # Older checkpoints are superseded; *.tmp folders are saves that a crash interrupted.
    for old in final_dir.parent.iterdir():
        if old != final_dir and (_CHECKPOINT_NAME.fullmatch(old.name) or old.name.endswith(".tmp")):
            shutil.rmtree(old)


def warmup_cosine(warmup_steps: int, total_steps: int):
    """LR multiplier: linear warmup to 1, then cosine decay to 0.1 at the last step."""

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return lr_factor


def positive_int(text: str) -> int:
    """argparse type for sizes and counts: `--batch-size 0` fails at parse time, naming the flag."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value

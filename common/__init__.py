"""What every chapter shares unchanged: the embedded default, data packing, timers, memory and metrics."""

from pathlib import Path

from common.data import load_and_pack
from common.utils import (
    PhaseTimers,
    append_jsonl,
    checkpoint_dir,
    flops_per_token,
    latest_checkpoint,
    memory_stats,
    peak_bf16_flops,
    positive_int,
    publish_checkpoint,
    rank0_first,
    setup_logging,
    wandb_mode,
    warmup_cosine,
)

# The embedded default: a tiny Llama config with its tokenizer, and a small task dataset, both
# loaded through the same calls as a Hub name (see common/make_tiny_default.py).
DEFAULT_MODEL = str(Path(__file__).parent / "tiny_llama")
DEFAULT_DATASET = str(Path(__file__).parent / "tiny_tasks")

__all__ = [
    "DEFAULT_DATASET",
    "DEFAULT_MODEL",
    "PhaseTimers",
    "append_jsonl",
    "checkpoint_dir",
    "flops_per_token",
    "latest_checkpoint",
    "load_and_pack",
    "memory_stats",
    "peak_bf16_flops",
    "positive_int",
    "publish_checkpoint",
    "rank0_first",
    "setup_logging",
    "wandb_mode",
    "warmup_cosine",
]

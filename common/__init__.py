"""What every chapter shares unchanged: the embedded default, flags, data, checkpoints, timers, memory, metrics."""

from common.args import base_parser, positive_float
from common.checkpoints import (
    check_resume,
    check_save_dir,
    checkpoint_dir,
    latest_checkpoint,
    loading,
    publish_checkpoint,
    rng_state,
    saving,
    set_rng_state,
)
from common.data import DEFAULT_DATASET, load_and_pack
from common.model import (
    DEFAULT_MODEL,
    adamw_param_groups,
    load_config_and_tokenizer,
    transformer_blocks,
)
from common.utils import (
    NonFiniteGuard,
    PhaseTimers,
    StopSignal,
    flops_per_token,
    log_metrics,
    memory_stats,
    peak_bf16_flops,
    rank0_first,
    record,
    setup_logging,
    shard_memory,
    wandb_mode,
    warmup_cosine,
)

__all__ = [
    "DEFAULT_DATASET",
    "DEFAULT_MODEL",
    "NonFiniteGuard",
    "PhaseTimers",
    "StopSignal",
    "adamw_param_groups",
    "base_parser",
    "check_resume",
    "check_save_dir",
    "checkpoint_dir",
    "flops_per_token",
    "latest_checkpoint",
    "load_and_pack",
    "load_config_and_tokenizer",
    "log_metrics",
    "loading",
    "memory_stats",
    "peak_bf16_flops",
    "positive_float",
    "publish_checkpoint",
    "rank0_first",
    "record",
    "rng_state",
    "saving",
    "set_rng_state",
    "setup_logging",
    "shard_memory",
    "transformer_blocks",
    "wandb_mode",
    "warmup_cosine",
]

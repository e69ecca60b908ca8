"""What every chapter shares unchanged: the embedded default, flags, data, checkpoints, timers, memory, metrics."""

import logging

# Where torchao is installed, transformers imports it as it builds a model, and torchao says that its
# compiled kernels for other formats (MX, CUTLASS: built for another torch) do not load, and torch that
# torchao registers an enum the old way. Neither is used by any chapter (chapter 06's float8 runs on
# torch's own FP8 matmul): those lines alone are dropped, so that they do not read as errors.
logging.getLogger("torchao").addFilter(lambda record: not record.getMessage().startswith("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(lambda record: "is an Enum subclass" not in record.getMessage())

from common.args import base_parser, non_negative_int, positive_float, positive_int
from common.checkpoints import (
    AsyncCheckpoints,
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
    checkpointing_options,
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
    "AsyncCheckpoints",
    "DEFAULT_DATASET",
    "DEFAULT_MODEL",
    "NonFiniteGuard",
    "PhaseTimers",
    "StopSignal",
    "adamw_param_groups",
    "base_parser",
    "check_resume",
    "check_save_dir",
    "checkpointing_options",
    "checkpoint_dir",
    "flops_per_token",
    "latest_checkpoint",
    "load_and_pack",
    "load_config_and_tokenizer",
    "log_metrics",
    "loading",
    "memory_stats",
    "non_negative_int",
    "peak_bf16_flops",
    "positive_float",
    "positive_int",
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

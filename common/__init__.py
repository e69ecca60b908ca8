"""What every chapter shares unchanged, one purpose per file: flags (args), data, model, checkpoints,
distributed (one rank first, errors, stop signals) and metrics (logs, timers, memory, MFU, wandb)."""

import logging

# Where torchao is installed, transformers imports it as it builds a model, and torchao says that its
# compiled kernels for other formats (MX, CUTLASS: built for another torch) do not load, and torch that
# torchao registers an enum the old way. Neither is used by any chapter (chapter 06's float8 runs on
# torch's own FP8 matmul): those lines alone are dropped, so that they do not read as errors.
logging.getLogger("torchao").addFilter(lambda line: not line.getMessage().startswith("Failed to load"))
logging.getLogger("torch.utils._pytree").addFilter(lambda line: "is an Enum subclass" not in line.getMessage())

# The chapters call these as common.<name>.
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
from common.distributed import StopSignal, rank0_first, record
from common.metrics import (
    NonFiniteGuard,
    PhaseTimers,
    flops_per_token,
    log_metrics,
    memory_stats,
    peak_bf16_flops,
    setup_logging,
    shard_memory,
    wandb_mode,
)
from common.model import (
    DEFAULT_MODEL,
    adamw_param_groups,
    checkpointing_options,
    load_config_and_tokenizer,
    transformer_blocks,
)

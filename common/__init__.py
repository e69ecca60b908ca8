"""What every chapter shares unchanged, one purpose per file: flags (args), data, model, checkpoints,
distributed (one rank first, errors, stop signals), logs (log lines, metrics.jsonl, wandb), timers (phases,
the straggler) and metrics (memory, MFU, the non-finite guard)."""

import logging

# Where torchao is installed, transformers imports it as it builds a model, and torchao warns of compiled
# kernels (MX, CUTLASS) that no chapter uses; torch, of an enum torchao registers the old way. Not errors.
for name in ["torchao", "torch.utils._pytree"]:
    logging.getLogger(name).setLevel(logging.ERROR)

# The chapters call these as common.<name>.
from common.args import base_parser, non_negative_float, non_negative_int, positive_float, positive_int
from common.checkpoints import AsyncCheckpoints, check_resume, check_save_dir, checkpoint_dir, latest_checkpoint
from common.checkpoints import check_shared_save_dir, loading, publish_checkpoint, rng_state, saving
from common.checkpoints import set_rng_state
from common.data import DEFAULT_DATASET, load_and_pack
from common.distributed import StopSignal, destroy_process_group_and_exit, no_forward_buffer_sync
from common.distributed import rank0_first, record
from common.logs import log_metrics, setup_logging, wandb_mode
from common.metrics import NonFiniteGuard, flops_per_token, memory_stats, peak_bf16_flops, shard_memory
from common.timers import PhaseTimers
from common.model import DEFAULT_MODEL, DEFAULT_MOE_MODEL, adamw_param_groups, check_compilable, checkpoint_blocks
from common.model import load_config_and_tokenizer
from common.model import transformer_blocks

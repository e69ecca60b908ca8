"""What every chapter shares, one purpose per module: args (flags), data (and chat: conversations;
mixture: several sources),
model, loss (the mean over trained tokens),
activation_checkpointing, checkpoints, async_checkpoints, signals (stopping), distributed, logs,
timers (phases, stragglers), metrics (memory, FLOPs, the NaN guard)."""

import logging

# transformers imports torchao (where installed) as it builds a model: torchao warns of kernels no
# chapter uses (MX, CUTLASS), torch of an enum torchao registers the old way. Not errors.
# torch.utils._pytree's logger: private, checked on torch 2.11-2.14. If it moves: no error: a
# warning line comes back at start: quiet the module that now warns.
for name in ["torchao", "torch.utils._pytree"]:
    logging.getLogger(name).setLevel(logging.ERROR)

# The chapters call these as common.<name>.
from common.activation_checkpointing import checkpoint_blocks
from common.args import base_parser, non_negative_float, non_negative_int, positive_float
from common.args import positive_int
from common.async_checkpoints import AsyncCheckpoints
from common.checkpoints import check_resume, check_save_dir, check_shared_save_dir, checkpoint_dir
from common.checkpoints import latest_checkpoint, loading, publish_checkpoint, rng_state, saving
from common.checkpoints import set_rng_state
from common.data import DEFAULT_DATASET, load_and_pack, load_data, steps_per_epoch
from common.distributed import destroy_process_group_and_exit, no_forward_buffer_sync
from common.distributed import rank0_first, record
from common.loss import all_reduce_mean, num_items_in_batch
from common.mixture import Mixture, per_source
from common.mixture import key as mixture_key
from common.logs import log_metrics, setup_logging, wandb_mode
from common.metrics import NonFiniteGuard, flops_per_token, memory_stats, peak_bf16_flops
from common.metrics import shard_memory
from common.model import DEFAULT_MODEL, DEFAULT_MOE_MODEL, adamw_param_groups, check_compilable
from common.model import experts_modules
from common.model import load_config_and_tokenizer, transformer_blocks
from common.signals import StopSignal
from common.timers import PhaseTimers

"""Chapter 03: data-parallel training across machines (DDP over several nodes).

    torchrun --nnodes 2 --nproc-per-node gpu --rdzv-backend c10d --rdzv-endpoint HEAD_HOST:29500 \
        03-multi-node/train_llm.py        # the same command on every node; see launch.sbatch

With no arguments it trains a tiny Llama on a small task dataset, both shipped in common/.
Rerunning the same command resumes from the last checkpoint in --save-dir/--experiment-name.
"""

import functools
import gc
import json
import logging
import math
import os
import secrets
import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import tqdm
import wandb
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

import common

logger = logging.getLogger(__name__)


@common.record  # a rank's error goes to torchrun's failure summary, the last lines of a failed job
def main():
    # --- 1. Setup: flags, device, precision ---
    # The imports' ~370k objects live until exit: no full collection (~0.3 s, mid-step) scans them.
    gc.freeze()
    args = get_parser().parse_args()
    if "RANK" not in os.environ:  # started by plain python: no launcher said which rank this is
        raise SystemExit(f"error: start this chapter with torchrun --standalone --nproc-per-node 2 {__file__}")
    # torchrun starts one process per GPU and tells each who it is.
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    dp_size, dp_rank = world_size, rank  # data parallel: rows of its own (05, 07, 08: shared)
    # Rank 0 speaks for the job; the others only report warnings and errors.
    prefix = f"[{socket.gethostname()} rank={rank}] "  # its host: rank order ignores any host list
    common.setup_logging(prefix=prefix, level=logging.INFO if rank == 0 else logging.WARNING)
    logger.info(args)
    # torchrun --max-restarts restarts all workers if one fails, resuming from the last checkpoint.
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        logger.warning(f"Workers restarted {os.environ['TORCHELASTIC_RESTART_COUNT']} time(s): resuming")

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no GPU is visible (did the job request GPUs?)")
    device = init_distributed(args, device_type, local_rank)
    # fp32 weights and optimizer state; matmuls in bf16 on GPU, fp32 on CPU.
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    autocast = functools.partial(torch.autocast, device.type, dtype=dtype, enabled=dtype != torch.float32)
    use_compile = args.compile if args.compile is not None else device.type == "cuda"

    # --- 2. Config and tokenizer ---
    # Everything that can fail on bad input happens before anything is written.
    common.check_save_dir(args.save_dir)
    with common.rank0_first(local=args.node_local_cache):
        config, tokenizer = common.load_config_and_tokenizer(
            args.model_name, args.seq_length, args.chat_template
        )
    common.check_compilable(config, use_compile)  # a MoE's router logits and compiled blocks
    # Export in the model's published dtype (bf16 for most), read now: an fp32 build overwrites it.
    export_dtype = getattr(torch, args.export_dtype) if args.export_dtype else config.dtype or torch.float32

    # --- 3. Data: text or conversations, tokenized, packed into rows, validation rows held out ---
    with common.rank0_first(local=args.node_local_cache):
        train_data, val_data = common.load_data(args, tokenizer, val_rows=dp_size * args.batch_size)
    # An optimizer step is --grad-accum-steps micro-batches of --batch-size rows on each dp rank.
    global_batch_rows = dp_size * args.batch_size * args.grad_accum_steps
    steps_per_epoch = common.steps_per_epoch(train_data, global_batch_rows, args)  # or refused
    total_steps = min(args.num_epochs * steps_per_epoch, args.max_steps or math.inf)
    logger.info(f"{len(train_data)} rows of {args.seq_length} tokens, {steps_per_epoch} steps per epoch")

    # --- 4. Model ---
    # Built on the CPU from the seed: every chapter starts from the same weights.
    torch.manual_seed(args.seed)
    with common.rank0_first(local=args.node_local_cache):  # a first run downloads the weights
        model = build_model(args, config)
    if args.activation_checkpointing:
        # Blocks keep inputs (selective: some matmul and attention outputs too), recompute the rest.
        common.checkpoint_blocks(common.transformer_blocks(model), args.activation_checkpointing)
    model = model.to(device)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(f"{num_params:,} parameters")

    # --- 5. Optimizer and LR schedule ---
    params = common.adamw_param_groups(model, args.weight_decay)  # fused: one kernel, GPU or CPU
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, args.beta2), fused=True)
    # Linear warmup from 0 over --warmup-steps, then cosine decay to 10% of --lr at the last step.
    lr_scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, args.warmup_steps, total_steps, min_lr_rate=0.1
    )

    # --- 6. Resume from the last checkpoint, if there is one ---
    exp_dir = Path(args.save_dir) / args.experiment_name
    # The data position counts steps of global_batch_rows rows of seq_length tokens.
    layout = {"global_batch_rows": global_batch_rows, "seq_length": args.seq_length}
    layout["mixture"] = common.mixture_key(train_data)  # its sources and weights (or None)
    # One wandb id for the job, drawn by rank 0: every rank must name its run after the same id.
    wandb_run_id = [secrets.token_hex(4)]
    dist.broadcast_object_list(wandb_run_id, src=0)
    state = {"epoch": 0, "epoch_step": 0, "global_step": 0, "wandb_run_id": wandb_run_id[0], **layout}
    state |= {"running_loss": 0.0, "steps_since_log": 0}  # since the last log: same mean on resume
    checkpoint = common.latest_checkpoint(exp_dir)
    common.check_shared_save_dir(checkpoint)  # every rank resumes from rank 0's step
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, lr_scheduler, device)
        common.check_resume(checkpoint, state, layout)
        logger.info(f"Resumed from {checkpoint} at step {state['global_step']}")

    # DDP makes every rank start from rank 0's weights and averages the gradients across ranks
    # during backward, bucket by bucket, as the rest of backward runs. Not rank 0's buffers at
    # every forward (BatchNorm's statistics): an LLM's never change, and forward has no collectives.
    model = DistributedDataParallel(
        model, device_ids=[local_rank] if device.type == "cuda" else None, **common.no_forward_buffer_sync()
    )
    # Compiling the DDP model (not the module inside) lets the compiler overlap communication.
    if use_compile:
        model.compile()

    # --- 7. Train ---
    exp_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = exp_dir / "metrics.jsonl" if rank == 0 else None  # rank 0 logs the job's metrics
    init_wandb(args, exp_dir, state["wandb_run_id"])

    tokens_per_step = global_batch_rows * args.seq_length
    flops_per_step = tokens_per_step * common.flops_per_token(model, config, args.seq_length)
    peak_flops = common.peak_bf16_flops(device)
    timers = common.PhaseTimers(device, compare_ranks=True)  # logs name stragglers (DIAGNOSING.md)
    guard = common.NonFiniteGuard(device)
    stop = common.StopSignal()
    postfix = {}  # what the progress bar shows after the counts
    running_loss = state["running_loss"]
    steps_since_log, log_start = state["steps_since_log"], time.perf_counter()

    def due(every):  # every `every` steps, and at the last one
        return state["global_step"] % every == 0 or state["global_step"] == total_steps

    with tqdm.tqdm(total=total_steps, initial=state["global_step"], desc="training", disable=rank != 0) as progress:
        model.train()
        stopping = None
        while state["global_step"] < total_steps and not stopping:
            # Each dp rank takes every dp_size-th row of the same permutation: disjoint parts of one
            # global batch, the same rows chapter 01 trains on with a dp_size times larger batch.
            sampler = DistributedSampler(train_data, dp_size, dp_rank, shuffle=True, seed=args.seed, drop_last=True)
            sampler.set_epoch(state["epoch"])
            if isinstance(train_data, common.Mixture):  # in its order: every batch holds its shares
                sampler = train_data.order(args.seed, state["epoch"], dp_size, dp_rank)
            # On resume, this epoch's already-trained batches are skipped by index, never loaded.
            indices = list(sampler)[state["epoch_step"] * global_batch_rows // dp_size :]
            dataloader = DataLoader(
                train_data, args.batch_size, sampler=indices, drop_last=True, pin_memory=device.type == "cuda"
            )
            batches = iter(dataloader)

            for _ in range(min(len(dataloader) // args.grad_accum_steps, total_steps - state["global_step"])):
                loss, grad_norm = train_step(model, batches, optimizer, lr_scheduler, args, timers, autocast, device)

                state["global_step"] += 1
                state["epoch_step"] += 1
                progress.update()
                # Summed on the device: an .item() per step would wait for the GPU every step.
                running_loss += loss
                steps_since_log += 1
                guard.update(state["global_step"], loss, grad_norm)

                # A stop skips the evaluation, to save the checkpoint sooner (torchrun waits 30 s).
                stopping = stop.agreed(device)
                if due(args.log_freq):
                    timings = timers.summary(steps_since_log)  # GPU sync: elapsed spans queued work
                    elapsed = time.perf_counter() - log_start
                    guard.check()
                    metrics = {
                        "step": state["global_step"],
                        "epoch": state["epoch"],
                        "loss": running_loss.item() / steps_since_log,
                        "lr": lr_scheduler.get_last_lr()[0],
                        "grad_norm": grad_norm.item(),
                        "tokens_per_s": steps_since_log * tokens_per_step / elapsed,
                        **timings,
                        **common.memory_stats(device),
                    }
                    if peak_flops:
                        metrics["mfu"] = steps_since_log * flops_per_step / elapsed / (world_size * peak_flops)
                    common.log_metrics(metrics, metrics_file)
                    postfix.update(loss=f"{metrics['loss']:.3f}", tokens_per_s=f"{metrics['tokens_per_s']:.0f}")
                    progress.set_postfix(postfix)
                    running_loss, steps_since_log, log_start = 0.0, 0, time.perf_counter()

                if val_data is not None and not stopping and due(args.eval_every):
                    val = evaluate(model, val_data, args, device, autocast, dp_size, dp_rank)
                    common.log_metrics({"step": state["global_step"], **val}, metrics_file)
                    postfix.update({name: f"{loss:.3f}" for name, loss in val.items()})
                    progress.set_postfix(postfix)
                    log_start = time.perf_counter()  # evaluating is not training: out of tokens/s

                if due(args.ckpt_freq) or stopping:
                    guard.check()  # a model with NaN weights never becomes a checkpoint
                    state["running_loss"], state["steps_since_log"] = float(running_loss), steps_since_log
                    with timers("checkpoint"):  # what the save costs the training loop
                        # Same weights and optimizer state on all ranks: rank 0 writes for everyone.
                        if rank == 0:
                            save_checkpoint(
                                exp_dir, model.module, optimizer, lr_scheduler, state, device, args.keep_checkpoints
                            )
                        dist.barrier()  # no rank runs ahead (and may crash) until the save is done
                    log_start = time.perf_counter()  # saving is not training: out of tokens/s
                if stopping:
                    break

            if state["epoch_step"] == steps_per_epoch:
                state["epoch"] += 1
                state["epoch_step"] = 0

    # --- 8. Export ---
    if args.export_hf and not stopping and rank == 0:
        export_hf(model.module, config, tokenizer, args.export_hf, export_dtype)
    if stopping:  # Slurm may have stopped wandb's service with the same signal: leave it
        logger.info(f"Stopped by {stopping} at step {state['global_step']}: rerun the same command to resume")
    else:
        wandb.finish()
        logger.info(f"Done: {state['global_step']} steps in {exp_dir}")
    # DDP's reducer holds the process group: freed after it, exit can hang (pytorch#75097).
    del model
    common.destroy_process_group_and_exit()  # gloo's threads would outlive it: see its docstring


def train_step(model, batches, optimizer, lr_scheduler, args, timers, autocast, device):
    """Every rank calls this: one optimizer step on --grad-accum-steps micro-batches: loss and
    gradient norm, on device."""
    step_loss = 0.0
    with timers("data"):
        host = [next(batches) for _ in range(args.grad_accum_steps)]
        micro_batches = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in host]
    # Rows train different numbers of tokens: each micro-batch's summed loss over the step's
    # count sums to the step's mean over its tokens (not a mean of the micro-batches' means).
    num_items = common.all_reduce_mean(common.num_items_in_batch(host, device))
    for micro_step, batch in enumerate(micro_batches):
        # DDP all-reduces every backward unless told not to: earlier micro-steps only add locally.
        model.require_backward_grad_sync = micro_step == args.grad_accum_steps - 1
        with timers("forward"), autocast():
            # No KV cache: only generation needs it; its per-layer state makes compile recompile.
            loss = model(**batch, use_cache=False, num_items_in_batch=num_items).loss

        with timers("backward"):
            loss.backward()
        step_loss += loss.detach()
    # Each rank trained on other rows: the job's loss is their mean (one number, no GPU wait).
    step_loss = common.all_reduce_mean(step_loss)

    with timers("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm


def build_model(args, config):
    """The model in fp32 on CPU: seeded random weights, or --from-pretrained the published ones."""
    if not args.from_pretrained:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    try:
        return AutoModelForCausalLM.from_pretrained(args.model_name, dtype=torch.float32)
    except OSError as err:
        raise SystemExit(f"error: --from-pretrained {args.model_name!r}: {str(err).splitlines()[0]}") from err


def init_distributed(args, device_type, local_rank):
    """Joins the job (torchrun said where others are), returns the device: the local rank's GPU, or
    the CPU. A collective that waits longer than the timeout fails instead of hanging forever."""
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(minutes=args.dist_timeout), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=args.dist_timeout))
    return device


def init_wandb(args, exp_dir, run_id):
    """The run's wandb run, its id from the checkpoint: a resumed run continues its wandb run, and a
    new run (folder deleted, or another chapter under the same name) never continues an old one."""
    # One per rank (each rank's timings and memory are its own), grouped by job.
    rank = dist.get_rank()
    wandb_dir = exp_dir / f"rank-{rank}"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    wandb.init(
        dir=wandb_dir,
        id=f"{run_id}-{rank}",
        name=f"{args.experiment_name}-rank-{rank}",
        group=f"{args.experiment_name}-{run_id}",
        resume="allow",
        config=vars(args),
        mode=common.wandb_mode(),
    )


def export_hf(model, config, tokenizer, folder, dtype):
    """Writes a folder that `from_pretrained` loads: the weights in `dtype`, and the tokenizer."""
    full_state = model.state_dict()
    with torch.device("meta"):
        export_model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    export_model.load_state_dict({name: value.to(dtype) for name, value in full_state.items()}, assign=True)
    export_model.tie_weights()  # converted one by one, tied weights became two tensors again
    export_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    logger.info(f"Exported the model to {folder} in {dtype}")


@common.per_source  # {"val_loss": ...}, and a mixture's val_loss/<source>
def evaluate(model, val_data, args, device, autocast, dp_size, dp_rank) -> float:
    """Every rank calls this: the mean loss over the trained tokens of the first --eval-batches
    global batches of the validation rows, without gradients. It draws no random numbers, so
    training after it goes on exactly as without it."""
    global_batch = dp_size * args.batch_size
    rows = val_data.select(range(min(len(val_data), args.eval_batches * global_batch) // global_batch * global_batch))
    # Each dp rank takes every dp_size-th row; the ranks' sums over one count are all-reduced.
    sampler = DistributedSampler(rows, dp_size, dp_rank, shuffle=False)
    batches = list(DataLoader(rows, sampler=sampler, batch_size=args.batch_size))
    num_items = common.all_reduce_mean(common.num_items_in_batch(batches, device))
    total = torch.zeros((), device=device)
    model.eval()
    with torch.no_grad(), autocast():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            total += model(**batch, use_cache=False, num_items_in_batch=num_items).loss.float()
    model.train()
    return common.all_reduce_mean(total).item()


def save_checkpoint(exp_dir, model, optimizer, lr_scheduler, state, device, keep):
    """What exact resume needs: weights, optimizer moments, LR schedule, RNG, data position."""
    final_dir = common.checkpoint_dir(exp_dir, state["global_step"])
    # Written to a .tmp name, renamed when done: a crash mid-save leaves nothing resume would trust.
    tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
    with common.saving(tmp_dir, state["global_step"]):
        shutil.rmtree(tmp_dir, ignore_errors=True)
        tmp_dir.mkdir(parents=True)
        torch.save(model.state_dict(), tmp_dir / "model.pt")
        torch.save(optimizer.state_dict(), tmp_dir / "optimizer.pt")
        torch.save(lr_scheduler.state_dict(), tmp_dir / "lr_scheduler.pt")
        # Same seed, same random numbers on every rank: rank 0's RNG state is everyone's.
        torch.save(common.rng_state(device), tmp_dir / "rng.pt")
        (tmp_dir / "state.json").write_text(json.dumps(state))
        common.publish_checkpoint(tmp_dir, final_dir, keep)
    logger.info(f"Saved {final_dir}")


def load_checkpoint(checkpoint, model, optimizer, lr_scheduler, device) -> dict:
    with common.loading(checkpoint):
        model.load_state_dict(torch.load(checkpoint / "model.pt", map_location=device))
        optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", map_location=device))
        lr_scheduler.load_state_dict(torch.load(checkpoint / "lr_scheduler.pt"))
        common.set_rng_state(torch.load(checkpoint / "rng.pt"), device)
        return json.loads((checkpoint / "state.json").read_text())


def get_parser():
    parser = common.base_parser(__doc__, __file__)
    add = parser.add_argument
    add("--dist-timeout", type=common.positive_float, default=10, help="minutes a collective may wait, then fails")
    add("--node-local-cache", action="store_true", help="HF_HOME is on each node's disk: each node prepares the data")
    return parser


if __name__ == "__main__":
    main()

"""Chapter 01: train a causal language model on one GPU, or on the CPU.

    python 01-single-gpu/train_llm.py

With no arguments it trains a tiny Llama on a small task dataset, both shipped in common/.
Rerunning the same command resumes from the last checkpoint in --save-dir/--experiment-name.
"""

import functools
import gc
import json
import logging
import math
import secrets
import shutil
import time
from pathlib import Path

import torch
import tqdm
import wandb
from torch.utils.data import DataLoader, RandomSampler
from transformers import AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

import common

logger = logging.getLogger(__name__)


def main():
    # --- 1. Setup: flags, device, precision ---
    # The imports' ~370k objects live until exit: no full collection (~0.3 s, mid-step) scans them.
    gc.freeze()
    args = get_parser().parse_args()
    common.setup_logging()
    logger.info(args)

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no GPU is visible (did the job request GPUs?)")
    device = torch.device(device_type)
    # fp32 weights and optimizer state; matmuls in bf16 on GPU, fp32 on CPU.
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    autocast = functools.partial(torch.autocast, device.type, dtype=dtype, enabled=dtype != torch.float32)
    use_compile = args.compile if args.compile is not None else device.type == "cuda"

    # --- 2. Config and tokenizer ---
    # Everything that can fail on bad input happens before anything is written.
    common.check_save_dir(args.save_dir)
    config, tokenizer = common.load_config_and_tokenizer(
        args.model_name, args.seq_length, args.chat_template
    )
    common.check_compilable(config, use_compile)  # a MoE's router logits and compiled blocks
    # Export in the model's published dtype (bf16 for most), read now: an fp32 build overwrites it.
    export_dtype = getattr(torch, args.export_dtype) if args.export_dtype else config.dtype or torch.float32

    # --- 3. Data: text or conversations, tokenized, packed into rows, validation rows held out ---
    train_data, val_data = common.load_data(args, tokenizer, val_rows=args.batch_size)
    # An optimizer step trains on --grad-accum-steps micro-batches of --batch-size rows.
    global_batch_rows = args.batch_size * args.grad_accum_steps
    steps_per_epoch = common.steps_per_epoch(train_data, global_batch_rows, args)  # or refused
    total_steps = min(args.num_epochs * steps_per_epoch, args.max_steps or math.inf)
    logger.info(f"{len(train_data)} rows of {args.seq_length} tokens, {steps_per_epoch} steps per epoch")

    # --- 4. Model ---
    # Built on the CPU from the seed: every chapter starts from the same weights.
    torch.manual_seed(args.seed)
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
    state = {"epoch": 0, "epoch_step": 0, "global_step": 0, "wandb_run_id": secrets.token_hex(4), **layout}
    state |= {"running_loss": 0.0, "steps_since_log": 0}  # since the last log: same mean on resume
    checkpoint = common.latest_checkpoint(exp_dir)
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, lr_scheduler, device)
        common.check_resume(checkpoint, state, layout)
        logger.info(f"Resumed from {checkpoint} at step {state['global_step']}")

    # Compiles in place, so state_dict() keys stay those of the plain model.
    if use_compile:
        model.compile()

    # --- 7. Train ---
    exp_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = exp_dir / "metrics.jsonl"
    init_wandb(args, exp_dir, state["wandb_run_id"])

    tokens_per_step = global_batch_rows * args.seq_length
    flops_per_step = tokens_per_step * common.flops_per_token(model, config, args.seq_length)
    peak_flops = common.peak_bf16_flops(device)
    timers = common.PhaseTimers(device)
    guard = common.NonFiniteGuard(device)
    stop = common.StopSignal()
    postfix = {}  # what the progress bar shows after the counts
    running_loss = state["running_loss"]
    steps_since_log, log_start = state["steps_since_log"], time.perf_counter()

    def due(every):  # every `every` steps, and at the last one
        return state["global_step"] % every == 0 or state["global_step"] == total_steps

    with tqdm.tqdm(total=total_steps, initial=state["global_step"], desc="training") as progress:
        model.train()
        stopping = None
        while state["global_step"] < total_steps and not stopping:
            # Shuffled like DistributedSampler (a new permutation seeded with seed + epoch), so the
            # multi-GPU chapters see the very same batches.
            sampler = RandomSampler(train_data, generator=torch.Generator().manual_seed(args.seed + state["epoch"]))
            if isinstance(train_data, common.Mixture):  # in its order: every batch holds its shares
                sampler = train_data.order(args.seed, state["epoch"])
            # On resume, this epoch's already-trained batches are skipped by index, never loaded.
            indices = list(sampler)[state["epoch_step"] * global_batch_rows :]
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
                stopping = stop.name
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
                        metrics["mfu"] = steps_since_log * flops_per_step / elapsed / peak_flops
                    common.log_metrics(metrics, metrics_file)
                    postfix.update(loss=f"{metrics['loss']:.3f}", tokens_per_s=f"{metrics['tokens_per_s']:.0f}")
                    progress.set_postfix(postfix)
                    running_loss, steps_since_log, log_start = 0.0, 0, time.perf_counter()

                if val_data is not None and not stopping and due(args.eval_every):
                    val = evaluate(model, val_data, args, device, autocast)
                    common.log_metrics({"step": state["global_step"], **val}, metrics_file)
                    postfix.update({name: f"{loss:.3f}" for name, loss in val.items()})
                    progress.set_postfix(postfix)
                    log_start = time.perf_counter()  # evaluating is not training: out of tokens/s

                if due(args.ckpt_freq) or stopping:
                    guard.check()  # a model with NaN weights never becomes a checkpoint
                    state["running_loss"], state["steps_since_log"] = float(running_loss), steps_since_log
                    with timers("checkpoint"):  # what the save costs the training loop
                        save_checkpoint(exp_dir, model, optimizer, lr_scheduler, state, device, args.keep_checkpoints)
                    log_start = time.perf_counter()  # saving is not training: out of tokens/s
                if stopping:
                    break

            if state["epoch_step"] == steps_per_epoch:
                state["epoch"] += 1
                state["epoch_step"] = 0

    # --- 8. Export ---
    if args.export_hf and not stopping:
        export_hf(model, config, tokenizer, args.export_hf, export_dtype)
    if stopping:  # Slurm may have stopped wandb's service with the same signal: leave it
        logger.info(f"Stopped by {stopping} at step {state['global_step']}: rerun the same command to resume")
    else:
        wandb.finish()
        logger.info(f"Done: {state['global_step']} steps in {exp_dir}")


def train_step(model, batches, optimizer, lr_scheduler, args, timers, autocast, device):
    """One optimizer step on --grad-accum-steps micro-batches: loss and gradient norm, on device."""
    step_loss = 0.0
    with timers("data"):
        host = [next(batches) for _ in range(args.grad_accum_steps)]
        micro_batches = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in host]
    # Rows train different numbers of tokens: each micro-batch's summed loss over the step's
    # count sums to the step's mean over its tokens (not a mean of the micro-batches' means).
    num_items = common.num_items_in_batch(host, device)
    for batch in micro_batches:
        with timers("forward"), autocast():
            # No KV cache: only generation needs it; its per-layer state makes compile recompile.
            loss = model(**batch, use_cache=False, num_items_in_batch=num_items).loss

        with timers("backward"):
            loss.backward()
        step_loss += loss.detach()

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


def init_wandb(args, exp_dir, run_id):
    """The run's wandb run, its id from the checkpoint: a resumed run continues its wandb run, and a
    new run (folder deleted, or another chapter under the same name) never continues an old one."""
    wandb.init(
        dir=exp_dir,
        id=run_id,
        name=args.experiment_name,
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
def evaluate(model, val_data, args, device, autocast) -> float:
    """The mean loss over the trained tokens of the first --eval-batches global batches of the
    validation rows, without gradients. It draws no random numbers, so training after it goes on
    exactly as without it."""
    global_batch = args.batch_size
    rows = val_data.select(range(min(len(val_data), args.eval_batches * global_batch) // global_batch * global_batch))
    batches = list(DataLoader(rows, batch_size=args.batch_size))
    num_items = common.num_items_in_batch(batches, device)  # as in training: one count for all
    total = torch.zeros((), device=device)
    model.eval()
    with torch.no_grad(), autocast():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            total += model(**batch, use_cache=False, num_items_in_batch=num_items).loss.float()
    model.train()
    return total.item()


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
    return common.base_parser(__doc__, __file__)


if __name__ == "__main__":
    main()

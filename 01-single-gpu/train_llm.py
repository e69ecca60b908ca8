"""Chapter 01: train a causal language model on one GPU, or on the CPU.

    python 01-single-gpu/train_llm.py

With no arguments it trains a tiny Llama on a small task dataset, both shipped in common/.
Rerunning the same command resumes from the last checkpoint in --save-dir/--experiment-name.
"""

import argparse
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common import (
    DEFAULT_DATASET,
    DEFAULT_MODEL,
    PhaseTimers,
    append_jsonl,
    checkpoint_dir,
    flops_per_token,
    latest_checkpoint,
    load_and_pack,
    memory_stats,
    peak_bf16_flops,
    positive_int,
    publish_checkpoint,
    setup_logging,
    wandb_mode,
    warmup_cosine,
)

logger = logging.getLogger(__name__)


def main():
    args = get_parser().parse_args()
    setup_logging()
    logger.info(args)

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no GPU is visible (did the job request GPUs?)")
    device = torch.device(device_type)
    # fp32 weights and optimizer state; matmuls in bf16 on GPU (autocast), fp32 on CPU.
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    use_compile = args.compile if args.compile is not None else device.type == "cuda"

    # Everything that can fail on bad input happens before anything is written.
    try:
        config = AutoConfig.from_pretrained(args.model_name)
        tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    except OSError as err:
        raise SystemExit(f"error: --model-name {args.model_name!r}: {str(err).splitlines()[0]}") from err
    if args.seq_length > config.max_position_embeddings:
        raise SystemExit(
            f"error: --seq-length {args.seq_length} is longer than the model's "
            f"max_position_embeddings ({config.max_position_embeddings}); pass a smaller --seq-length"
        )

    train_data = load_and_pack(args.dataset_name, tokenizer, args.seq_length)
    steps_per_epoch = len(train_data) // args.batch_size
    if steps_per_epoch == 0:
        raise SystemExit(
            f"error: --batch-size {args.batch_size} is larger than the dataset ({len(train_data)} rows of "
            f"{args.seq_length} tokens); pass a smaller --batch-size or --seq-length"
        )
    total_steps = min(args.num_epochs * steps_per_epoch, args.max_steps or math.inf)
    logger.info(f"{len(train_data)} rows of {args.seq_length} tokens, {steps_per_epoch} steps per epoch")

    # Built on the CPU and then moved, so every chapter starts from the same weights for a seed.
    torch.manual_seed(args.seed)
    if args.from_pretrained:
        try:
            model = AutoModelForCausalLM.from_pretrained(args.model_name, dtype=torch.float32)
        except OSError as err:
            raise SystemExit(f"error: --from-pretrained {args.model_name!r}: {str(err).splitlines()[0]}") from err
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(device)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(f"{num_params:,} parameters")

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=device.type == "cuda")
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(args.warmup_steps, total_steps))

    exp_dir = Path(args.save_dir) / args.experiment_name
    state = {
        "epoch": 0,
        "epoch_step": 0,
        "global_step": 0,
        "running_loss": 0.0,  # summed since the last log line: a resumed run logs the same mean
        "steps_since_log": 0,
        "wandb_run_id": secrets.token_hex(4),
    }
    checkpoint = latest_checkpoint(exp_dir)
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, lr_scheduler, device)
        logger.info(f"Resumed from {checkpoint} at step {state['global_step']}")

    # Compiles in place, so state_dict() keys stay those of the plain model.
    if use_compile:
        model.compile()

    exp_dir.mkdir(parents=True, exist_ok=True)
    wandb.init(
        dir=exp_dir,
        id=state["wandb_run_id"],
        name=args.experiment_name,
        resume="allow",
        config=vars(args),
        mode=wandb_mode(),
    )

    tokens_per_step = args.batch_size * args.seq_length
    flops_per_step = tokens_per_step * flops_per_token(model, config, args.seq_length)
    peak_flops = peak_bf16_flops(device)
    timers = PhaseTimers(device)
    progress = tqdm.tqdm(total=total_steps, initial=state["global_step"], desc="training", dynamic_ncols=True)
    running_loss, steps_since_log, log_start = state["running_loss"], state["steps_since_log"], time.perf_counter()

    model.train()
    while state["global_step"] < total_steps:
        # Shuffled like DistributedSampler (a fresh permutation seeded with seed + epoch), so the
        # multi-GPU chapters see the very same batches.
        sampler = RandomSampler(train_data, generator=torch.Generator().manual_seed(args.seed + state["epoch"]))
        # On resume, the batches this epoch already trained on are skipped by index, never loaded.
        indices = list(sampler)[state["epoch_step"] * args.batch_size :]
        dataloader = DataLoader(
            train_data, sampler=indices, batch_size=args.batch_size, drop_last=True, pin_memory=device.type == "cuda"
        )
        batches = iter(dataloader)

        for _ in range(min(len(dataloader), total_steps - state["global_step"])):
            with timers("data"):
                batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}

            with timers("forward"), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                # No KV cache: it serves generation, and its per-layer state would make compile recompile.
                loss = model(**batch, use_cache=False).loss

            with timers("backward"):
                loss.backward()

            with timers("optimizer"):
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)

            state["global_step"] += 1
            state["epoch_step"] += 1
            progress.update()
            # Accumulated on the device: calling .item() every step would wait for the GPU every step.
            running_loss += loss.detach()
            steps_since_log += 1

            if state["global_step"] % args.log_freq == 0 or state["global_step"] == total_steps:
                timings = timers.summary()  # waits for the GPU: the elapsed time then covers all queued work
                elapsed = time.perf_counter() - log_start
                metrics = {
                    "step": state["global_step"],
                    "epoch": state["epoch"],
                    "loss": running_loss.item() / steps_since_log,
                    "lr": lr_scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": steps_since_log * tokens_per_step / elapsed,
                    **timings,
                    **memory_stats(device),
                }
                if peak_flops:
                    metrics["mfu"] = steps_since_log * flops_per_step / elapsed / peak_flops
                append_jsonl(exp_dir / "metrics.jsonl", metrics)
                wandb.log(metrics, step=state["global_step"])
                progress.set_postfix(loss=f"{metrics['loss']:.3f}", tokens_per_s=f"{metrics['tokens_per_s']:.0f}")
                running_loss, steps_since_log, log_start = 0.0, 0, time.perf_counter()

            if state["global_step"] % args.ckpt_freq == 0 or state["global_step"] == total_steps:
                state["running_loss"], state["steps_since_log"] = float(running_loss), steps_since_log
                save_checkpoint(exp_dir, model, optimizer, lr_scheduler, state, device)
                log_start = time.perf_counter()  # saving is not training: keep it out of tokens/s

        if state["epoch_step"] == steps_per_epoch:
            state["epoch"] += 1
            state["epoch_step"] = 0

    progress.close()
    wandb.finish()
    logger.info(f"Done: {state['global_step']} steps in {exp_dir}")


def save_checkpoint(exp_dir, model, optimizer, lr_scheduler, state, device):
    """Everything exact resume needs: weights, optimizer moments, LR schedule, RNG, data position."""
    final_dir = checkpoint_dir(exp_dir, state["global_step"])
    # Written under a temporary name and renamed when complete: a crash mid-save leaves no
    # checkpoint that resume would trust.
    tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    torch.save(model.state_dict(), tmp_dir / "model.pt")
    torch.save(optimizer.state_dict(), tmp_dir / "optimizer.pt")
    torch.save(lr_scheduler.state_dict(), tmp_dir / "lr_scheduler.pt")
    rng = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    torch.save(rng, tmp_dir / "rng.pt")
    (tmp_dir / "state.json").write_text(json.dumps(state))
    publish_checkpoint(tmp_dir, final_dir)
    logger.info(f"Saved {final_dir}")


def load_checkpoint(checkpoint, model, optimizer, lr_scheduler, device) -> dict:
    try:
        model.load_state_dict(torch.load(checkpoint / "model.pt", map_location=device))
        optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", map_location=device))
        lr_scheduler.load_state_dict(torch.load(checkpoint / "lr_scheduler.pt"))
        rng = torch.load(checkpoint / "rng.pt")
        state = json.loads((checkpoint / "state.json").read_text())
    except Exception as err:
        raise SystemExit(
            f"error: checkpoint {checkpoint} cannot be loaded ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "remove it to start the experiment over, or pass a new --experiment-name"
        ) from err
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)
    return state


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # One folder per chapter by default, so running the chapters one after another never mixes runs.
    parser.add_argument("--experiment-name", default=Path(__file__).parent.name, help="run folder under --save-dir")
    parser.add_argument("--save-dir", default="outputs")
    parser.add_argument("--model-name", default=DEFAULT_MODEL, help="Hub model name or local folder")
    parser.add_argument("--dataset-name", default=DEFAULT_DATASET, help="Hub dataset name or local folder")
    parser.add_argument("--from-pretrained", action="store_true", help="load the model's weights, not just its config")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-epochs", type=positive_int, default=1)
    parser.add_argument("--max-steps", type=positive_int, help="stop after this many steps (default: all epochs)")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--seq-length", type=positive_int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], help="default: cuda if a GPU is visible; cuda never falls back to the CPU"
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], help="compute dtype (default: bf16 on GPU)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, help="torch.compile (default: on GPU)")
    parser.add_argument("--log-freq", type=positive_int, default=10)
    parser.add_argument("--ckpt-freq", type=positive_int, default=200)
    return parser


if __name__ == "__main__":
    main()

"""Chapter 02: data-parallel training on the GPUs of one machine (DDP), or on CPU processes.

    torchrun --standalone --nproc-per-node gpu 02-multi-gpu/train_llm.py

With no arguments it trains a tiny Llama on a small task dataset, both shipped in common/.
Rerunning the same command resumes from the last checkpoint in --save-dir/--experiment-name.
"""

import argparse
import json
import logging
import math
import os
import secrets
import shutil
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import tqdm
import wandb
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
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
    rank0_first,
    setup_logging,
    wandb_mode,
    warmup_cosine,
)

logger = logging.getLogger(__name__)


@record  # a failing rank writes its traceback to TORCHELASTIC_ERROR_FILE, which torchrun reports
def main():
    args = get_parser().parse_args()
    # torchrun starts one process per GPU and tells each who it is.
    rank, local_rank, world_size = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    # Rank 0 speaks for the job; the others only report warnings and errors.
    setup_logging(prefix=f"[rank={rank}] ", level=logging.INFO if rank == 0 else logging.WARNING)
    logger.info(args)

    device_type = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but no GPU is visible (did the job request GPUs?)")
    # A collective that waits longer than the timeout fails instead of hanging forever.
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(minutes=10), device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    # fp32 weights and optimizer state; matmuls in bf16 on GPU (autocast), fp32 on CPU.
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    use_compile = args.compile if args.compile is not None else device.type == "cuda"

    # Everything that can fail on bad input happens before anything is written.
    try:
        with rank0_first():
            config = AutoConfig.from_pretrained(args.model_name)
            tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    except OSError as err:
        raise SystemExit(f"error: --model-name {args.model_name!r}: {str(err).splitlines()[0]}") from err
    if args.seq_length > config.max_position_embeddings:
        raise SystemExit(
            f"error: --seq-length {args.seq_length} is longer than the model's "
            f"max_position_embeddings ({config.max_position_embeddings}); pass a smaller --seq-length"
        )

    with rank0_first():
        train_data = load_and_pack(args.dataset_name, tokenizer, args.seq_length)
    # --batch-size is per rank: each step trains on world_size * batch_size rows.
    steps_per_epoch = len(train_data) // (args.batch_size * world_size)
    if steps_per_epoch == 0:
        raise SystemExit(
            f"error: --batch-size {args.batch_size} on {world_size} ranks is larger than the dataset "
            f"({len(train_data)} rows of {args.seq_length} tokens); pass a smaller --batch-size or --seq-length"
        )
    total_steps = min(args.num_epochs * steps_per_epoch, args.max_steps or math.inf)
    logger.info(f"{len(train_data)} rows of {args.seq_length} tokens, {steps_per_epoch} steps per epoch")

    # Built on the CPU and then moved, so every chapter starts from the same weights for a seed.
    torch.manual_seed(args.seed)
    if args.from_pretrained:
        try:
            with rank0_first():
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
    # One wandb id for the job, drawn by rank 0: every rank must name its run after the same id.
    wandb_run_id = [secrets.token_hex(4)]
    dist.broadcast_object_list(wandb_run_id, src=0)
    state = {
        "epoch": 0,
        "epoch_step": 0,
        "global_step": 0,
        "running_loss": 0.0,  # summed since the last log line: a resumed run logs the same mean
        "steps_since_log": 0,
        "wandb_run_id": wandb_run_id[0],
    }
    checkpoint = latest_checkpoint(exp_dir)
    if checkpoint is not None:
        state = load_checkpoint(checkpoint, model, optimizer, lr_scheduler, device)
        logger.info(f"Resumed from {checkpoint} at step {state['global_step']}")

    # DDP makes every rank start from rank 0's weights and averages the gradients across ranks
    # during backward, bucket by bucket, while the rest of backward still runs.
    model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    # Compiling the DDP model (not the module inside) lets the compiler overlap communication.
    if use_compile:
        model.compile()

    # One wandb run per rank (each rank's timings and memory are its own), grouped by job. The
    # ids come from the checkpoint, as in chapter 01: a new run never continues an old one.
    wandb_dir = exp_dir / f"rank-{rank}"
    wandb_dir.mkdir(parents=True, exist_ok=True)
    wandb.init(
        dir=wandb_dir,
        id=f"{state['wandb_run_id']}-{rank}",
        name=f"{args.experiment_name}-rank-{rank}",
        group=f"{args.experiment_name}-{state['wandb_run_id']}",
        resume="allow",
        config=vars(args),
        mode=wandb_mode(),
    )

    tokens_per_step = world_size * args.batch_size * args.seq_length
    flops_per_step = tokens_per_step * flops_per_token(model, config, args.seq_length)
    peak_flops = peak_bf16_flops(device)
    timers = PhaseTimers(device)
    progress = tqdm.tqdm(
        total=total_steps, initial=state["global_step"], desc="training", dynamic_ncols=True, disable=rank != 0
    )
    # Rank 0 carries the job's loss sum from before the checkpoint; the others start from zero.
    running_loss = state["running_loss"] if rank == 0 else 0.0
    steps_since_log, log_start = state["steps_since_log"], time.perf_counter()

    model.train()
    while state["global_step"] < total_steps:
        # Each rank takes every world_size-th row of the same permutation: disjoint slices of one
        # global batch, the same rows chapter 01 trains on with a world_size times larger batch.
        sampler = DistributedSampler(train_data, shuffle=True, seed=args.seed, drop_last=True)
        sampler.set_epoch(state["epoch"])
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
                # Each rank saw other rows: the job's loss is the mean over ranks.
                dist.all_reduce(running_loss, op=dist.ReduceOp.SUM)
                timings = timers.summary()  # waits for the GPU: the elapsed time then covers all queued work
                elapsed = time.perf_counter() - log_start
                metrics = {
                    "step": state["global_step"],
                    "epoch": state["epoch"],
                    "loss": running_loss.item() / steps_since_log / world_size,
                    "lr": lr_scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": steps_since_log * tokens_per_step / elapsed,
                    **timings,
                    **memory_stats(device),
                }
                if peak_flops:
                    metrics["mfu"] = steps_since_log * flops_per_step / elapsed / (world_size * peak_flops)
                if rank == 0:
                    append_jsonl(exp_dir / "metrics.jsonl", metrics)
                wandb.log(metrics, step=state["global_step"])
                progress.set_postfix(loss=f"{metrics['loss']:.3f}", tokens_per_s=f"{metrics['tokens_per_s']:.0f}")
                running_loss, steps_since_log, log_start = 0.0, 0, time.perf_counter()

            if state["global_step"] % args.ckpt_freq == 0 or state["global_step"] == total_steps:
                job_loss = torch.tensor(float(running_loss), device=device)
                dist.all_reduce(job_loss, op=dist.ReduceOp.SUM)
                state["running_loss"], state["steps_since_log"] = job_loss.item(), steps_since_log
                # All ranks hold the same weights and optimizer state: rank 0 writes for everyone.
                if rank == 0:
                    save_checkpoint(exp_dir, model.module, optimizer, lr_scheduler, state, device)
                # No rank runs ahead (and may crash) before the checkpoint is complete.
                dist.barrier()
                log_start = time.perf_counter()  # saving is not training: keep it out of tokens/s

        if state["epoch_step"] == steps_per_epoch:
            state["epoch"] += 1
            state["epoch_step"] = 0

    progress.close()
    wandb.finish()
    logger.info(f"Done: {state['global_step']} steps in {exp_dir}")
    dist.destroy_process_group()


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
    # Every rank seeded alike and drew the same random numbers: rank 0's RNG state is everyone's.
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

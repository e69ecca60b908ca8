"""Chapter 08: pipeline parallel: the blocks cut into --pp-size stages, each rank runs its stage's
micro-batches in a schedule's order, activations sent on, gradients back. FSDP2 shards each stage.

    torchrun --standalone --nproc-per-node gpu 08-pipeline-parallel/train_llm.py --pp-size 2

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
import torch.distributed.checkpoint as dcp
import tqdm
import wandb
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

import common
from common import published  # published weights in and out, each rank its own slices

# isort: split
# The chapter's own module, beside this script: what each stage holds, and the refusals.
import pipeline

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
    # FSDP's mixed precision casts the weights for the matmuls itself: no autocast.
    autocast = functools.partial(torch.autocast, device.type, enabled=False)
    use_compile = args.compile if args.compile is not None else device.type == "cuda"
    # The outer mesh dimension: --pp-size stages of consecutive ranks (nodes), between which only
    # activations and their gradients pass. FSDP shards each stage over its dp ranks, all by default
    # (--shard-size fewer: HSDP, a replica per group, all-gathers and reduce-scatters inside it).
    dp_size = world_size // args.pp_size
    shard_size = args.shard_size or dp_size
    pipeline.check_layout(args, world_size, shard_size)
    mesh_shape, mesh_dim_names = (args.pp_size, dp_size // shard_size, shard_size), ("pp", "replicate", "shard")
    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=mesh_dim_names)
    # A pipeline's --pp-size ranks, a dp_size apart (pp is the outer dimension), share its rows.
    dp_rank = rank % dp_size

    # --- 2. Config and tokenizer ---
    # Everything that can fail on bad input happens before anything is written.
    common.check_save_dir(args.save_dir)
    with common.rank0_first(local=args.node_local_cache):
        config, tokenizer = common.load_config_and_tokenizer(
            args.model_name, args.seq_length, args.chat_template
        )
        # --from-pretrained: the published safetensors, downloaded once per node (or a folder's).
        weights = published.pretrained_weights(args.model_name, config) if args.from_pretrained else None
    common.check_compilable(config, use_compile)  # a MoE's router logits and compiled blocks
    published.agree_on_export_folder(args.export_hf, config, args.model_name)  # new, seen by all
    # Export in the model's published dtype (bf16 for most), read now: an fp32 build overwrites it.
    export_dtype = getattr(torch, args.export_dtype) if args.export_dtype else config.dtype or torch.float32

    # --- 3. Data: text or conversations, tokenized, packed into rows, validation rows held out ---
    with common.rank0_first(local=args.node_local_cache):
        val_rows = world_size * args.batch_size  # one evaluation batch on every rank
        train_data, val_data = common.load_data(args, tokenizer, val_rows)
    # An optimizer step is --grad-accum-steps micro-batches of --pp-size x --batch-size rows in each
    # pipeline (cut into --pp-microbatches): chapter 04's rows for as many ranks.
    global_batch_rows = world_size * args.batch_size * args.grad_accum_steps
    steps_per_epoch = common.steps_per_epoch(train_data, global_batch_rows, args)  # or refused
    total_steps = min(args.num_epochs * steps_per_epoch, args.max_steps or math.inf)
    logger.info(f"{len(train_data)} rows of {args.seq_length} tokens, {steps_per_epoch} steps per epoch")

    # --- 4. Model ---
    # Seeded weights are built whole on rank 0's CPU and sent: every chapter starts from the same
    # ones. Published weights are read by each rank, its own slices only (load_pretrained).
    torch.manual_seed(args.seed)
    full_model = build_model(args, config) if rank == 0 and not weights else None
    # Each rank builds the model on the meta device (shapes, no memory), allocating only its shards.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.activation_checkpointing:
        # Blocks keep inputs (selective: some matmul and attention outputs too), recompute the rest.
        common.checkpoint_blocks(common.transformer_blocks(model), args.activation_checkpointing)
    # Found once, now: fully_shard changes each block's class, and then the names would not match.
    blocks = common.transformer_blocks(model)
    pipeline.check_model(model, blocks, args)
    # The whole model's, before the cut into stages.
    flops_per_token = common.flops_per_token(model, config, args.seq_length)
    # This rank's stages (pp rank r's: r, r + pp, ... in looped schedules), each its own module, and
    # `model` cut down to theirs: what the optimizer and checkpoints see, under chapter 04's names.
    num_stages, stage_ids = pipeline.rank_stages(args, mesh["pp"].get_local_rank())
    stage_modules, my_blocks = pipeline.split(model, blocks, stage_ids, num_stages)
    for stage_module in stage_modules:  # each its own FSDP root, driven by its PipelineStage
        stage_blocks = [block for block in my_blocks if block in set(stage_module.modules())]
        parallelize(stage_module, stage_blocks, mesh, args, dtype, use_compile)
        stage_module.to_empty(device="cpu" if args.cpu_offload else device)  # allocated through it
    if weights:
        load_pretrained(model, weights)
    else:
        send_full_weights(model, full_model, device)
    del full_model
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(f"{num_params:,} parameters in stages {stage_ids} of {num_stages}, sharded over {shard_size} ranks")
    # Each stage sends outputs over the pp group to the next stage's rank (next node), shapes given.
    stages = [
        PipelineStage(stage_module, i, num_stages, device, group=mesh["pp"].get_group(),
                      **pipeline.shapes(args, config, dtype, i, num_stages))
        for i, stage_module in zip(stage_ids, stage_modules)
    ]  # fmt: skip
    # The schedule cuts batches into micro-batches, runs this rank's forward and backward in order.
    schedule = get_schedule_class(args.pp_schedule)(
        stages if len(stages) > 1 else stages[0], n_microbatches=pipeline.microbatch_count(args),
        loss_fn=functools.partial(model.loss_function, vocab_size=config.vocab_size), scale_grads=False,
    )  # fmt: skip

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

    # --- 7. Train ---
    exp_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = exp_dir / "metrics.jsonl" if rank == 0 else None  # rank 0 logs the job's metrics
    init_wandb(args, exp_dir, state["wandb_run_id"])

    tokens_per_step = global_batch_rows * args.seq_length
    flops_per_step = tokens_per_step * flops_per_token
    peak_flops = common.peak_bf16_flops(device)
    # my_blocks: timed without FSDP's waits.
    timers = common.PhaseTimers(device, compare_ranks=True, blocks=my_blocks)
    guard = common.NonFiniteGuard(device)
    stop = common.StopSignal()
    async_saves = common.AsyncCheckpoints(args.dist_timeout, device, optimizer) if args.async_checkpoints else None
    postfix = {}  # what the progress bar shows after the counts
    running_loss = state["running_loss"]
    steps_since_log, log_start = state["steps_since_log"], time.perf_counter()

    def due(every):  # every `every` steps, and at the last one
        return state["global_step"] % every == 0 or state["global_step"] == total_steps

    with tqdm.tqdm(total=total_steps, initial=state["global_step"], desc="training", disable=rank != 0) as progress:
        model.train()
        stopping = None
        while state["global_step"] < total_steps and not stopping:
            # Each pipeline (a dp rank's ranks, one per stage) takes every dp_size-th row of the
            # same permutation: --batch-size rows per rank; the first stage needs their tokens, the
            # last their labels.
            sampler = DistributedSampler(train_data, dp_size, dp_rank, shuffle=True, seed=args.seed, drop_last=True)
            sampler.set_epoch(state["epoch"])
            if isinstance(train_data, common.Mixture):  # in its order: every batch holds its shares
                sampler = train_data.order(args.seed, state["epoch"], dp_size, dp_rank)
            # On resume, this epoch's already-trained batches are skipped by index, never loaded.
            indices = list(sampler)[state["epoch_step"] * global_batch_rows // dp_size :]
            dataloader = DataLoader(
                train_data, args.pp_size * args.batch_size, sampler=indices, drop_last=True,
                pin_memory=device.type == "cuda",
            )  # fmt: skip
            batches = iter(dataloader)

            for _ in range(min(len(dataloader) // args.grad_accum_steps, total_steps - state["global_step"])):
                loss, grad_norm = train_step(
                    model, schedule, batches, optimizer, lr_scheduler, args, timers, device, mesh["pp"].get_group()
                )

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
                        **common.shard_memory(model, optimizer),
                    }
                    if peak_flops:
                        metrics["mfu"] = steps_since_log * flops_per_step / elapsed / (world_size * peak_flops)
                    common.log_metrics(metrics, metrics_file)
                    postfix.update(loss=f"{metrics['loss']:.3f}", tokens_per_s=f"{metrics['tokens_per_s']:.0f}")
                    progress.set_postfix(postfix)
                    running_loss, steps_since_log, log_start = 0.0, 0, time.perf_counter()

                if val_data is not None and not stopping and due(args.eval_every):
                    val = evaluate(model, schedule, val_data, args, device, autocast, dp_size, dp_rank)
                    common.log_metrics({"step": state["global_step"], **val}, metrics_file)
                    postfix.update({name: f"{loss:.3f}" for name, loss in val.items()})
                    progress.set_postfix(postfix)
                    log_start = time.perf_counter()  # evaluating is not training: out of tokens/s

                if due(args.ckpt_freq) or stopping:
                    guard.check()  # a model with NaN weights never becomes a checkpoint
                    state["running_loss"], state["steps_since_log"] = float(running_loss), steps_since_log
                    with timers("checkpoint"):  # what the save costs the training loop
                        save_checkpoint(
                            exp_dir, model, optimizer, lr_scheduler, state, device, args.keep_checkpoints, async_saves
                        )
                    log_start = time.perf_counter()  # saving is not training: out of tokens/s
                if stopping:
                    break

            if state["epoch_step"] == steps_per_epoch:
                state["epoch"] += 1
                state["epoch_step"] = 0

    # --- 8. Export ---
    if async_saves:
        async_saves.close()  # stop or end: wait for the last checkpoint to be written and published
    if args.export_hf and not stopping:
        export_hf(model, config, tokenizer, args.export_hf, export_dtype)
    if stopping:  # Slurm may have stopped wandb's service with the same signal: leave it
        logger.info(f"Stopped by {stopping} at step {state['global_step']}: rerun the same command to resume")
    else:
        wandb.finish()
        logger.info(f"Done: {state['global_step']} steps in {exp_dir}")
    common.destroy_process_group_and_exit()  # gloo's threads would outlive it: see its docstring


def train_step(model, schedule, batches, optimizer, lr_scheduler, args, timers, device, pp_group):
    """Every rank calls this: one optimizer step on --grad-accum-steps micro-batches: loss and
    gradient norm, on device."""
    step_loss = torch.zeros((), device=device)  # the last stage's losses; 0 on the other stages
    with timers("data"):
        host = [next(batches) for _ in range(args.grad_accum_steps)]
        micro_batches = [{k: v.to(device, non_blocking=True) for k, v in b.items()} for b in host]
    # Rows train different numbers of tokens: each micro-batch's summed loss over the step's
    # count sums to the step's mean over its tokens, however the schedule cuts the rows.
    # Over every rank's rows (each pp rank counts its pipeline's: the world's size divides
    # that out): each rank's sum over the job's count per rank, averaged.
    num_items = common.all_reduce_mean(common.num_items_in_batch(host, device))
    for batch in micro_batches:
        # Position ids, where rows hold them, go to every stage: each document kept apart.
        positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}

        with timers("pipeline"):
            # This rank's stages' forwards and backwards in the schedule's order: the first stage
            # reads the tokens, the last the labels. FSDP reduce-scatters a stage's gradients after
            # its last backward.
            losses, loss_kwargs = [], {"num_items_in_batch": num_items}
            schedule.step(batch["input_ids"], target=batch["labels"], losses=losses, loss_kwargs=loss_kwargs,
                          return_outputs=False, **positions)  # logits freed after each backward
        step_loss += sum(loss.detach() for loss in losses)
    # A pipeline's loss is on its last stage (others hold 0): the sum over the world, divided by
    # the number of pipelines (the dp ranks), is the job's mean.
    dist.all_reduce(step_loss, op=dist.ReduceOp.SUM)
    step_loss /= dist.get_world_size() // args.pp_size  # the dp size

    with timers("optimizer"):
        # The norm of all stages' gradients, not this stage's: one direction for the whole model.
        grad_norm = pipeline.clip_grad_norm_(model.parameters(), args.max_grad_norm, pp_group)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return step_loss, grad_norm


def build_model(args, config):
    """The model in fp32 on CPU, its seeded random weights."""
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def load_pretrained(model, folder):
    """Every rank calls this: --from-pretrained: each rank reads only its own slices of the
    published safetensors (DCP's Hugging Face reader: bf16 on disk copied into fp32 shards) and
    builds the buffers no file holds (rotary frequencies): no rank holds the whole model."""
    published.build_buffers(model)
    state = published.published_state(model, get_model_state_dict(model))
    with published.loading_pretrained(folder):
        dcp.load(state, storage_reader=published.weights_reader(folder))


def send_full_weights(model, full_model, device):
    """Every rank calls this: rank 0's full weights (`full_model`, else None), sent per tensor into
    every rank's shards."""
    rank = dist.get_rank()
    full_state = full_model.state_dict() if rank == 0 else {}
    # Not strict: rank 0's full weights hold every stage's; each rank's model, only its own stages'.
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    missing = set_model_state_dict(model, full_state, options=options).missing_keys
    if missing:  # a tensor of this rank's stages that rank 0's model does not have: never here
        raise RuntimeError(f"rank 0's full weights lack {missing}")
    # Non-state-dict buffers (rotary frequencies) are sent too: every stage's, by rank 0's names.
    pipeline.send_buffers(model, full_model, device)


def parallelize(model, blocks, mesh, args, dtype, use_compile):
    """What the chapter does to the model, in the required order (torchtitan's parallelize_llama
    is the model; main() has switched on activation checkpointing): compile, then FSDP."""
    if use_compile:
        # Each block alone (FSDP's hooks between blocks stay uncompiled), and whole (fullgraph): a
        # graph break would silently split it: collectives and casts between the pieces uncompiled.
        for block in blocks:
            block.compile(fullgraph=True)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy()
    # A 2-D mesh is HSDP to fully_shard; with one group, its 1-D shard dimension is plain FSDP.
    fsdp_mesh = mesh["replicate", "shard"] if mesh["replicate"].size() > 1 else mesh["shard"]
    apply_fsdp(model, blocks, fsdp_mesh, mp_policy, offload_policy, args)


def apply_fsdp(model, blocks, mesh, mp_policy, offload_policy, args):
    """Shards units: input embeddings, each block, output head; then the root (the rest). A unit's
    weights all-gathered only for forward and backward, gradients reduce-scattered when ready, while
    the next unit computes. The root's stay gathered all step: the largest, embeddings and head, are units (untied).
    In a pipeline, units stay gathered across all micro-batches' forwards and backwards (torchtitan
    does so): gathered for each, they would cost --pp-microbatches times the bytes."""
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    tied = model.config.tie_word_embeddings
    if not tied and model.get_input_embeddings() is not None:  # the first stage's
        shard(model.get_input_embeddings(), reshard_after_forward=args.pp_size == 1)
    for block in blocks:
        shard(block, reshard_after_forward=args.pp_size == 1)
    if not tied and model.get_output_embeddings() is not None:  # the last stage's
        # Backward needs the head right after forward: kept gathered in between, not gathered twice.
        shard(model.get_output_embeddings(), reshard_after_forward=False)
    shard(model)


def init_distributed(args, device_type, local_rank):
    """Joins the job (torchrun said where others are), returns the device: the local rank's GPU, or
    the CPU. A collective that waits longer than the timeout fails instead of hanging forever."""
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # --cpu-offload: collectives over CPU shards and gradients (clipping's norm) need gloo too.
        backend = "cuda:nccl,cpu:gloo" if args.cpu_offload else "nccl"
        dist.init_process_group(backend, timeout=timedelta(minutes=args.dist_timeout), device_id=device)
    else:
        if args.cpu_offload:
            raise SystemExit("error: --cpu-offload moves shards from GPU memory to the CPU: it needs GPUs")
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
    """Every rank calls this: writes a folder that `from_pretrained` and vLLM load, in `dtype`: each
    rank writes its shards (DCP's Hugging Face writer), then every rank merges some of the published
    files from them, a tensor at a time (published.exporting); config and tokenizer beside them."""
    state = published.published_state(model, get_model_state_dict(model), dtype)  # names and dtypes
    files = published.agree_on_file_index(state)  # which tensor goes in which published file
    with published.exporting(folder, files) as tmp:  # merged, then published whole
        writer = HuggingFaceStorageWriter(str(tmp / "shards"), files, save_distributed=True)
        dcp.save(state, storage_writer=writer)  # this rank's shards
        if dist.get_rank() == 0:
            published.published_config(config, dtype).save_pretrained(tmp)
            model.generation_config.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    logger.info(f"Exported the model to {folder} in {dtype}")


@common.per_source  # {"val_loss": ...}, and a mixture's val_loss/<source>
def evaluate(model, schedule, val_data, args, device, autocast, dp_size, dp_rank) -> float:
    """Every rank calls this: the mean loss over the trained tokens of the first --eval-batches
    global batches of the validation rows, without gradients. It draws no random numbers, so
    training after it goes on exactly as without it."""
    batch_size = args.pp_size * args.batch_size  # a pipeline's, cut into micro-batches
    global_batch = dp_size * batch_size
    rows = val_data.select(range(min(len(val_data), args.eval_batches * global_batch) // global_batch * global_batch))
    # Each pipeline takes every dp_size-th row; the last stages' sums over one count, all-reduced.
    sampler = DistributedSampler(rows, dp_size, dp_rank, shuffle=False)
    batches = list(DataLoader(rows, sampler=sampler, batch_size=batch_size))
    num_items = common.all_reduce_mean(common.num_items_in_batch(batches, device))
    total = torch.zeros((), device=device)
    model.eval()
    with torch.no_grad(), autocast():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            positions = {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}
            losses, loss_kwargs = [], {"num_items_in_batch": num_items}  # the last stage's
            schedule.eval(batch["input_ids"], target=batch["labels"], losses=losses,
                          loss_kwargs=loss_kwargs, return_outputs=False, **positions)  # fmt: skip
            total += sum(losses)
    model.train()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / dp_size  # one pipeline's last stage each


def save_checkpoint(exp_dir, model, optimizer, lr_scheduler, state, device, keep, async_saves=None):
    """Every rank calls this: everything exact resume needs: weights, optimizer moments, LR
    schedule, RNG, data position. With `async_saves`, returns once the CPU copy starts: written and
    published beside training."""
    final_dir = common.checkpoint_dir(exp_dir, state["global_step"])
    # Written to a .tmp name, renamed when done: a crash mid-save leaves nothing resume would trust.
    tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
    rank = dist.get_rank()
    with common.saving(tmp_dir, state["global_step"]):
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir.mkdir(parents=True)
            torch.save(lr_scheduler.state_dict(), tmp_dir / "lr_scheduler.pt")
            # Same seed, same random numbers on every rank: rank 0's RNG state is everyone's.
            torch.save(common.rng_state(device), tmp_dir / "rng.pt")
            (tmp_dir / "state.json").write_text(json.dumps(state))
        dist.barrier()
        # Each rank writes its shards; DCP maps each into the full tensor, so load can reshard.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        pipeline.name_every_stage(optimizer_state)  # named as chapter 04's: loads at any --pp-size
        shards = {"model": model_state, "optimizer": optimizer_state}
        if async_saves:
            async_saves.start(shards, tmp_dir, final_dir, state["global_step"], keep)
        else:
            dcp.save(shards, checkpoint_id=tmp_dir)
            if rank == 0:
                common.publish_checkpoint(tmp_dir, final_dir, keep)
                logger.info(f"Saved {final_dir}")
    dist.barrier()  # no rank runs ahead (and may crash) until the save is done, or under way


def load_checkpoint(checkpoint, model, optimizer, lr_scheduler, device) -> dict:
    """Every rank calls this: its shards loaded in place (DCP reshards them for this run's ranks),
    and the schedule, the RNG and the data position as rank 0 saved them."""
    with common.loading(checkpoint):
        # DCP loads in place into this run's shards, whatever the number of ranks that saved them.
        model_state, optimizer_state = get_state_dict(model, optimizer)
        shards = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(shards, checkpoint_id=checkpoint)
        set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])
        lr_scheduler.load_state_dict(torch.load(checkpoint / "lr_scheduler.pt"))
        common.set_rng_state(torch.load(checkpoint / "rng.pt"), device)
        return json.loads((checkpoint / "state.json").read_text())


def get_parser():
    parser = common.base_parser(__doc__, __file__)
    add = parser.add_argument
    add("--dist-timeout", type=common.positive_float, default=10, help="minutes a collective may wait, then fails")
    add("--node-local-cache", action="store_true", help="HF_HOME is on each node's disk: each node prepares the data")
    add("--shard-size", type=common.positive_int, help="ranks that shard the model (default: all; fewer: HSDP)")
    add("--cpu-offload", action="store_true", help="keep shards and optimizer on the CPU (GPU only)")
    add("--async-checkpoints", action="store_true", help="write checkpoints beside training")
    add("--pp-size", type=common.positive_int, default=1, help="ranks the model's blocks are cut over")
    add("--pp-schedule", choices=pipeline.SCHEDULES, default="1F1B", help="the order of the micro-batches' passes")
    add("--pp-microbatches", type=common.positive_int, help="micro-batches per pipeline step (default: one per row)")
    return parser


if __name__ == "__main__":
    main()

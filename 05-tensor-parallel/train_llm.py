"""Chapter 05: tensor and sequence parallel inside each node, FSDP across: a 2-D device mesh.

    torchrun --standalone --nproc-per-node gpu 05-tensor-parallel/train_llm.py --tp-size 2

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
import torch.nn.functional as F
import tqdm
import wandb
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, get_cosine_with_min_lr_schedule_with_warmup

import common
from common import published  # published weights in and out, each rank its own slices
import tp  # beside this script: the plan's checks, and other families' norms

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
    # Each --tp-size group of consecutive ranks trains on the rows of one dp rank, together.
    dp_size, dp_rank = world_size // args.tp_size, rank // args.tp_size
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
    # Three dimensions; tp (inner) groups --tp-size consecutive ranks: a node's GPUs, whose NVLink
    # carries TP's collectives in every block. Around it, chapter 04's (replicate, shard) FSDP.
    shard_size = args.shard_size or dp_size
    tp.check_layout(args, world_size, shard_size)  # sizes that divide the ranks; tp inside a node
    mesh_shape = (dp_size // shard_size, shard_size, args.tp_size)
    mesh = init_device_mesh(device.type, mesh_shape, mesh_dim_names=("replicate", "shard", "tp"))

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
    tp.check_tp_size(args.tp_size, config, args.seq_length)  # whole heads and whole tokens per rank

    # --- 3. Data: text or conversations, tokenized, packed into rows, validation rows held out ---
    with common.rank0_first(local=args.node_local_cache):
        train_data, val_data = common.load_data(args, tokenizer, val_rows=dp_size * args.batch_size)
    # An optimizer step is --grad-accum-steps micro-batches of --batch-size rows on each dp rank.
    global_batch_rows = dp_size * args.batch_size * args.grad_accum_steps
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
    parallelize(model, blocks, mesh, args, dtype, use_compile)
    model.to_empty(device="cpu" if args.cpu_offload else device)
    if weights:
        load_pretrained(model, weights)
    else:
        send_full_weights(model, full_model, device)
    del full_model
    num_params = sum(p.numel() for p in model.parameters())
    # The whole model's (a DTensor counts its full size), and how the ranks split it and the rows.
    logger.info(f"{num_params:,} parameters, mesh {mesh.mesh_dim_names} {mesh.shape}, dp {dp_size}")

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
    flops_per_step = tokens_per_step * common.flops_per_token(model, config, args.seq_length)
    peak_flops = common.peak_bf16_flops(device)
    # The blocks are timed without FSDP's waits.
    timers = common.PhaseTimers(device, compare_ranks=True, blocks=blocks)
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
                        **common.shard_memory(model, optimizer),
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
        # FSDP reduce-scatters micro-step gradients into the sharded sum: DDP's no-sync would keep a
        # full fp32 gradient per rank (30 GiB at 8B). Only HSDP's all-reduce awaits the last one.
        model.set_requires_all_reduce(micro_step == args.grad_accum_steps - 1)
        # loss_parallel: logits stay split over the vocabulary; cross-entropy combines the tp ranks'
        # parts ungathered: full-vocabulary logits are a small model's largest activation.
        with timers("forward"), autocast(), loss_parallel():
            # No KV cache: only generation needs it; its per-layer state makes compile recompile.
            # Positions too where rows hold them (documents apart); no labels: the loss is ours.
            logits = model(**(batch | {"labels": None}), use_cache=False).logits
            loss = next_token_loss(logits, batch["labels"], num_items)
            # Backward needs the loss's fp32 log-probabilities, not logits: freed now, not after it.
            del logits

        with timers("backward"), loss_parallel():
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
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Non-state-dict buffers (rotary frequencies) are sent too, to the device (to_empty: maybe CPU).
    for name, buffer in model.named_buffers():
        # TP replicated some over tp (Gemma's embedding scale): sent and kept as plain tensors.
        local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
        value = full_model.get_buffer(name).to(device) if rank == 0 else torch.empty_like(local, device=device)
        dist.broadcast(value, src=0)
        if isinstance(buffer, DTensor):
            value = DTensor.from_local(value, buffer.device_mesh, buffer.placements, run_check=False)
        module_name, _, buffer_name = name.rpartition(".")
        setattr(model.get_submodule(module_name), buffer_name, value)


def parallelize(model, blocks, mesh, args, dtype, use_compile):
    """What the chapter does to the model, in the required order (torchtitan's parallelize_llama
    is the model; main() enabled activation checkpointing): tensor parallel, compile, then FSDP."""
    # TP first, then FSDP shards the TP shards over dp: each weight is split in two dimensions.
    if args.tp_size > 1:
        apply_tp(model, blocks, mesh["tp"])
    if use_compile:
        # Each block alone (FSDP's hooks between blocks stay uncompiled), and whole (fullgraph): a
        # graph break would silently split it: collectives and casts between the pieces uncompiled.
        for block in blocks:
            block.compile(fullgraph=True)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy()
    # A 2-D mesh is HSDP to fully_shard; with one group, its 1-D shard dimension is plain FSDP.
    fsdp_mesh = mesh["replicate", "shard"] if mesh["replicate"].size() > 1 else mesh["shard"]
    apply_fsdp(model, blocks, fsdp_mesh, mp_policy, offload_policy)


def apply_fsdp(model, blocks, mesh, mp_policy, offload_policy):
    """Shards units: input embeddings, each block, output head; then the root (the rest). A unit's
    weights all-gathered only for forward and backward, gradients reduce-scattered when ready, while
    the next unit computes. The root's stay gathered all step: the largest, embeddings and head, are units (untied)."""
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    tied = model.config.tie_word_embeddings
    if not tied:
        shard(model.get_input_embeddings())
    for block in blocks:
        shard(block)
    if not tied:
        # Backward needs the head right after forward: kept gathered in between, not gathered twice.
        shard(model.get_output_embeddings(), reshard_after_forward=False)
    shard(model)


def apply_tp(model, blocks, tp_mesh):
    """Splits each block's matmuls over tp ranks (Megatron-LM's tensor parallel), its norms over the
    tokens (sequence parallel), the embedding and head over the vocabulary (README: "How it works").
    The plan names Llama's modules, as in Mistral, Qwen, others; HF calls attention by keyword."""
    root_plan = {
        # The embedding's output is the first residual stream: split over the tokens. It stays a
        # DTensor (use_local_output=False), whose shape HF reads as the full sequence's.
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False
        ),
        "model.norm": SequenceParallel(),
        # The logits stay split over the vocabulary for loss_parallel.
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    block_plan = {
        "self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    }
    # The norms other families add; and any module the plan does not name, refused (tp.py).
    block_plan |= tp.norm_plan(blocks[0], model.config)
    tp.check_plan(model, blocks, root_plan, block_plan, tp_mesh)
    parallelize_module(model, tp_mesh, root_plan)
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan)
    if model.config.tie_word_embeddings:
        # Both split alike over the vocabulary (dim 0), but into two new parameters: tie them again.
        model.lm_head.weight = model.model.embed_tokens.weight


def next_token_loss(logits, labels, num_items):
    """Every rank calls this (under loss_parallel, the cross-entropy all-reduces over tp): chapter
    01's loss (HF's from labels): fp32 cross-entropy of next-token predictions, summed and divided
    by the step's count of them (`num_items`, common.num_items_in_batch); labels -100 ignored."""
    labels = F.pad(labels, (0, 1), value=-100)[:, 1:]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
    # Under loss_parallel, equal on every tp rank: its local copy, which backward goes through.
    return (loss.to_local() if isinstance(loss, DTensor) else loss) / num_items


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
    with torch.no_grad(), autocast(), loss_parallel():
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            logits = model(**(batch | {"labels": None}), use_cache=False).logits
            total += next_token_loss(logits, batch["labels"], num_items)
    model.train()
    return common.all_reduce_mean(total).item()  # each tp rank's is counted: the same


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
    add("--tp-size", type=common.positive_int, default=1, help="ranks that split each layer (a node's GPUs or fewer)")
    add("--shard-size", type=common.positive_int, help="ranks that shard the model (default: all; fewer: HSDP)")
    add("--cpu-offload", action="store_true", help="keep shards and optimizer on the CPU (GPU only)")
    add("--async-checkpoints", action="store_true", help="write checkpoints beside training")
    return parser


if __name__ == "__main__":
    main()

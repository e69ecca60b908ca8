"""What one GPU holds at the peak of a training step, measured on a CPU, beside what tools.plan predicts.

PyTorch's FSDPMemTracker runs the chapter's own parallelize and train_step on a model of the real
shape under fake tensors (no memory, no arithmetic), with the fake process-group backend playing
rank 0 of the whole job: every tensor FSDP2, DTensor and AdamW allocate is counted, by kind, at the
step's peak. Any size runs in minutes on a laptop. Not compiled (fake tensors cannot be), so the
planner is asked for the eager step too. Chapter 04's step (FSDP, HSDP), chapter 05's with --tp-size
(FSDP x TP), chapter 07's with --cp-size (FSDP x CP, its ring attention on the fake process group), or
chapter 09's with --ep-size (FSDP x EP: its all-to-alls, their split sizes even, as the planner assumes);
chapter 10's with --pp-size (or --tp-size with --cp-size), and --ep-size for its experts, on the first rank
of the first stage, of the last (--last-stage) or of any (--pp-rank).

    python -m tools.memory tools/model_shapes/llama-3.1-8b --batch-size 2 --seq-length 4096 --grad-accum-steps 2
    python -m tools.memory tools/model_shapes/llama-3.1-70b --nodes 4 --tp-size 8 --batch-size 8 \\
        --seq-length 4096 --activation-checkpointing
    python -m tools.memory tools/model_shapes/llama-3.1-8b --cp-size 8 --batch-size 1 --seq-length 131072 \\
        --activation-checkpointing
    python -m tools.memory tools/model_shapes/qwen3-30b-a3b --nodes 2 --ep-size 8 --batch-size 2 \\
        --seq-length 4096 --activation-checkpointing
    python -m tools.memory tools/model_shapes/deepseek-v3 --nodes 64 --pp-size 8 --ep-size 32 --pp-rank 1 \\
        --batch-size 1 --seq-length 4096 --activation-checkpointing
"""

import argparse
import contextlib
import functools
import os
import time
from unittest import mock

import torch
import torch.distributed as dist

from tools.chapters import chapter_module
from tools.plan import GIB, Layout, count, plan

def load(chapter: str):
    """The chapter's script as a module, with the modules beside it (tools/chapters.py's one loader)."""
    return chapter_module(chapter)


def tracked_peak(chapter, config, mesh, argv, cp_mesh=None, expert_mesh=None) -> dict:
    """GiB that rank 0 holds at the peak of the chapter's second training step (the first makes AdamW's
    state), by FSDPMemTracker's kinds, "Total" included. `mesh`: the chapter's (replicate, shard,
    tp) mesh, or (replicate, shard) for chapters 04, 07 and 09; `argv`: the chapter's flags; `cp_mesh`:
    chapter 07's (dp, cp) mesh, which its train_step takes; `expert_mesh`: chapter 09's (replicate,
    efsdp, ep) mesh."""
    # Private, checked on torch 2.11-2.14. FakeTensorMode, if it moves: tools.memory (and
    # tests/test_tools.py) fails at import: import them from their new module.
    # FSDPMemTracker, if it moves: tools.memory fails at import or on a kind it reads ("Sharded
    # Param", ...): import it from its new module, with its kinds' new names.
    # _sharding_prop.detect_fake_mode, if it moves: tools.memory fails (mock.patch: no such
    # attribute) or counts those tensors: patch what DTensor's sharding propagation then calls.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.tensor import _sharding_prop
    from transformers import AutoModelForCausalLM, masking_utils
    from transformers.utils import import_utils

    from common import PhaseTimers, checkpoint_blocks, transformer_blocks

    args = chapter.get_parser().parse_args(argv)
    device = torch.device("cpu")
    if expert_mesh is not None:  # as chapter 09's main(): the routers' balancing loss on
        chapter.experts.set_balancing_loss(config, args)
    # transformers counts fake tensors as tracing, and then builds a causal mask and repeats keys and values
    # for every head, which a real step does not (20 KB per token per block at 8B); it takes the real
    # step's path with fake tensors not tracing, and no packed sequences found, as in the chapters' rows.
    not_tracing = mock.patch.object(masking_utils, "is_tracing", lambda tensor=None: import_utils.is_tracing())
    not_packed = mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    # transformers' internals, checked on transformers 5.0-5.24. If they move: tools.memory fails
    # (mock.patch: no such attribute) or counts a mask a real step does not build: patch what
    # masking_utils then calls.
    # Built on the meta device as the chapters build it (no memory), out of fake tensors' way: FSDP's
    # meshes compute their coordinates from real rank tensors.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.activation_checkpointing:  # as the chapter's main applies it
        checkpoint_blocks(transformer_blocks(model), args.activation_checkpointing)
    step_args, layers, meshes = (), (), (mesh,)
    if expert_mesh is not None:  # as chapter 09's main(): its layers of experts, and their mesh
        layers, meshes = (chapter.experts.check_model(model, args, torch.bfloat16),), (mesh, expert_mesh)
    if cp_mesh is not None:  # as chapter 07's main(): the CPU's kernel on the ring, and SDPA with no mask
        chapter.cpu_ring_attention.register(device)
        chapter.ring.use_ring_attention(model, args)
        step_args = (cp_mesh,)
    chapter.parallelize(model, transformer_blocks(model), *meshes, args, torch.bfloat16, use_compile=False)
    # DTensor derives each op's output shape on full-size tensors, in the fake mode it finds: in one of its own,
    # as on a real run, where FSDPMemTracker leaves them out.
    own_mode = mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None)
    splits = contextlib.ExitStack()
    if expert_mesh is not None:
        splits.callback(even_splits())
    with FakeTensorMode(allow_non_fake_inputs=True), not_tracing, not_packed, own_mode, splits, gpu_attention():
        model.to_empty(device=device)
        # One tensor at a time, as GPUs' fused AdamW updates them: foreach's temporaries are each the size of
        # all moments, and the fused kernel's fake version returns new tensors of that size.
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        tracker = FSDPMemTracker(model, optimizer)

        def batches():
            while True:
                ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq_length))
                yield {"input_ids": ids, "labels": ids}

        # The tracker takes one forward per module: one micro-step at a time, the stats cleared
        # before each forward (train_step takes its micro-batches before the first). A global hook:
        # it runs before the model's own, FSDP's pre-forward (which the tracker wraps) among them.
        def reset_stats(module, _):
            if module is model:
                tracker.reset_mod_stats()

        hook = torch.nn.modules.module.register_module_forward_pre_hook(reset_stats)

        autocast = functools.partial(torch.autocast, device.type, enabled=False)
        micro_batches = batches()
        step = functools.partial(chapter.train_step, model, *layers, micro_batches, optimizer, lr_scheduler, args)
        # A first step untracked, in which AdamW makes its moments.
        step(PhaseTimers(device), autocast, device, *step_args)
        with tracker:
            step(PhaseTimers(device), autocast, device, *step_args)
        hook.remove()
    return {getattr(kind, "value", kind): value / GIB for kind, value in tracker.get_tracker_snapshot("peak")[device].items()}


@contextlib.contextmanager
def composed_rank(chapter, config, argv, world_size: int, before_micro_batch=lambda: None):
    """Chapter 10 as its main() builds it (its meshes, the cut into this rank's stages, parallelize,
    the schedule) on the rank the fake process group plays, in fake tensors: yields (model, its
    stage modules, the optimizer, step), where step() runs one train_step of random rows, calling
    `before_micro_batch` before each micro-batch a stage runs and each micro-step."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # private: see tracked_peak's imports
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.stage import PipelineStage
    from torch.distributed.tensor import _sharding_prop
    from transformers import AutoModelForCausalLM, masking_utils
    from transformers.utils import import_utils

    from common import PhaseTimers, checkpoint_blocks, transformer_blocks

    args = chapter.get_parser().parse_args(argv)
    device = torch.device("cpu")
    dims = chapter.ParallelDims(args, world_size, dist.get_rank())
    not_tracing = mock.patch.object(masking_utils, "is_tracing", lambda tensor=None: import_utils.is_tracing())
    not_packed = mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if args.activation_checkpointing:
        checkpoint_blocks(transformer_blocks(model), args.activation_checkpointing)
    blocks = transformer_blocks(model)
    all_experts = chapter.prepare_model(model, blocks, args, torch.bfloat16)
    dims.build_meshes(device, experts=bool(all_experts))
    chapter.cpu_ring_attention.register(device)
    num_stages, stage_ids = chapter.pipeline.rank_stages(args, dims.pp_rank)
    stage_modules = [model]
    if args.pp_size > 1:
        stage_modules, blocks = chapter.pipeline.split(model, blocks, stage_ids, num_stages)
    chapter.parallelize(model, stage_modules, blocks, dims, args, torch.bfloat16, use_compile=False)
    own_mode = mock.patch.object(_sharding_prop, "detect_fake_mode", lambda *args: None)
    splits = contextlib.ExitStack()
    if all_experts:  # 09's dispatch, its split sizes even (the planner's uniform routing)
        splits.callback(even_splits())
    # A pipeline's ranks first vote, by sends and receives, on whether every stage knows its
    # neighbours' shapes: the fake group's receives hold no votes. The chapter gives its shapes.
    # Private, checked on torch 2.13. If it moves: chapter 10's figures fail here (AttributeError)
    # or its stages try to exchange their shapes: set what the schedule's warm-up then reads.
    given = mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", shapes_given)
    run_micro_batch = PipelineStage.forward_maybe_with_nosync

    def announced(stage, *inputs, **kwargs):
        before_micro_batch()
        return run_micro_batch(stage, *inputs, **kwargs)

    each = mock.patch.object(PipelineStage, "forward_maybe_with_nosync", announced)
    with FakeTensorMode(allow_non_fake_inputs=True), not_tracing, not_packed, own_mode, given, each, splits, \
            gpu_attention():
        for stage_module in stage_modules:
            stage_module.to_empty(device=device)
        schedule = chapter.pipeline_schedule(stage_modules, stage_ids, num_stages, dims, args, config,
                                             torch.bfloat16, device)  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), foreach=False)  # as tracked_peak's
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

        def batches():
            while True:
                before_micro_batch()
                ids = torch.randint(0, config.vocab_size, (args.pp_size * args.batch_size, args.seq_length))
                yield {"input_ids": ids, "labels": ids}

        step = functools.partial(chapter.train_step, model, schedule, batches(), optimizer, lr_scheduler, args)
        yield model, stage_modules, optimizer, lambda: step(PhaseTimers(device), dims)


def composed_peak(chapter, config, argv, world_size: int) -> dict:
    """Chapter 10's step on the rank the fake process group plays (the first stage's rank 0, or the
    last stage's): GiB at the peak of its second step (the first makes AdamW's state), by
    FSDPMemTracker's kinds. The tracker follows one forward per module at a time: it starts afresh
    at each micro-batch a stage runs (its peak, the step's, is kept)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    trackers = []
    with composed_rank(chapter, config, argv, world_size, lambda: [t.reset_mod_stats() for t in trackers]) as (
        _, stage_modules, optimizer, step,
    ):  # fmt: skip
        tracker = FSDPMemTracker(stage_modules[0], optimizer)
        trackers.append(tracker)
        step()  # AdamW makes its moments
        with tracker:
            step()
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {getattr(kind, "value", kind): value / GIB for kind, value in peak.items()}


def shapes_given(schedule, stages, has_backward, p2p_done):
    """The pipeline's warm-up vote, decided: every stage was given its shapes (static)."""
    from torch.distributed.pipelining._utils import InferenceMode  # private: see composed_peak

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


def gpu_attention():
    """SDPA as a GPU runs it where the CPU cannot: attention whose values are narrower than its
    queries and keys (DeepSeek-V3's multi-head latent attention: 192 and 128 per head) has no CPU
    flash kernel, and falls back to the math one, which keeps each head's seq x seq scores (in fp32,
    8 GiB a block at 4,096 tokens and 128 heads); an H100's SDPA runs it in the memory-efficient
    kernel, which keeps the output and one fp32 log-sum-exp per query and head. Here that kernel's
    own op, in fake tensors (its meta functions, its backward). The other calls are SDPA's."""
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, **kwargs):  # fmt: skip
        if value.shape[-1] == query.shape[-1] or kwargs or dropout_p:
            return sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **kwargs)
        # aten's private kernel op, checked on torch 2.13 (also listed for common's selective
        # checkpointing). If it moves: tools.memory fails here (AttributeError): call the kernel
        # SDPA then names for the memory-efficient attention.
        efficient = torch.ops.aten._scaled_dot_product_efficient_attention
        return efficient(query, key, value, attn_mask, True, 0.0, is_causal, scale=scale)[0]

    return mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", scaled_dot_product_attention)


def even_splits():
    """Chapter 09's dispatch reads its all-to-all's split sizes on the host (`tolist` of the copies each
    rank sends and receives), which fake tensors do not have: here the router's choices spread evenly
    over the ep ranks (the planner's assumption), each rank sending and receiving as many copies as it
    routed (the numel of the last expert ids it sorted). A real count exchange says the same on average.
    Also the dry runs' (tests/faults/dry_run.py). Returns the function that puts torch's back."""
    from torch._subclasses.fake_tensor import FakeTensor  # private: see tracked_peak's imports

    routed = {"copies": 0}
    argsort, tolist = torch.Tensor.argsort, FakeTensor.tolist

    def counting_argsort(self, *args, **kwargs):
        if self.dim() == 1 and not self.is_floating_point():
            routed["copies"] = self.numel()
        return argsort(self, *args, **kwargs)

    def even_tolist(self):
        if self.dim() != 1 or self.is_floating_point():
            return tolist(self)
        ranks = self.numel()
        return [routed["copies"] // ranks + (rank < routed["copies"] % ranks) for rank in range(ranks)]

    torch.Tensor.argsort, FakeTensor.tolist = counting_argsort, even_tolist

    def undo():
        torch.Tensor.argsort, FakeTensor.tolist = argsort, tolist

    return undo


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local folder with the model's config.json (tools/model_shapes has some)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--cp-size", type=int, default=1, help="context parallel (chapter 07)")
    parser.add_argument("--ep-size", type=int, default=1, help="expert parallel (chapter 09)")
    parser.add_argument("--shard-size", type=int, default=0, help="HSDP: dp ranks per shard group (default: all)")
    parser.add_argument("--activation-checkpointing", nargs="?", const="full", choices=["full", "selective"])
    parser.add_argument("--batch-size", type=int, default=1, help="rows per replica per micro-step")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--pp-size", type=int, default=1, help="pipeline stages (chapter 10, with tp and cp)")
    parser.add_argument("--pp-schedule", default="1F1B")
    parser.add_argument("--last-stage", action="store_true", help="play the last stage's rank, not rank 0")
    parser.add_argument("--pp-rank", type=int, help="play this pp rank's first rank (default: 0, or the last)")
    args = parser.parse_args(argv)
    if args.ep_size > 1 and max(args.tp_size, args.cp_size) > 1 and args.pp_size == 1:
        parser.error("--ep-size with --tp-size or --cp-size: chapter 10's, measured here with --pp-size")
    if args.pp_size > 1 or args.tp_size > 1 and args.cp_size > 1:  # chapter 10's mesh
        return main_composed(args)

    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig

    gpus = args.nodes * args.gpus_per_node
    dp = gpus // args.tp_size
    shard = args.shard_size or dp
    chapter = "05-tensor-parallel" if args.tp_size > 1 else "07-context-parallel" if args.cp_size > 1 else "04-fsdp"
    chapter = "09-expert-parallel" if args.ep_size > 1 else chapter
    argv = ["--batch-size", str(args.batch_size), "--seq-length", str(args.seq_length)]
    argv += ["--grad-accum-steps", str(args.grad_accum_steps), "--shard-size", str(shard)]
    if args.activation_checkpointing:
        argv += ["--activation-checkpointing", args.activation_checkpointing]

    dist.init_process_group("fake", rank=0, world_size=gpus)  # given no store, it makes its own
    cp_mesh = expert_mesh = None
    if chapter == "05-tensor-parallel":
        argv += ["--tp-size", str(args.tp_size)]
        mesh = init_device_mesh("cpu", (dp // shard, shard, args.tp_size), mesh_dim_names=("replicate", "shard", "tp"))
        for dims in ["tp", "shard", "replicate", ("replicate", "shard")]:
            mesh[dims].get_coordinate()
    else:
        mesh = init_device_mesh("cpu", (dp // shard, shard), mesh_dim_names=("replicate", "shard"))
    if chapter == "07-context-parallel":  # its rows over dp, each row's tokens over cp
        argv += ["--cp-size", str(args.cp_size)]
        cp_mesh = init_device_mesh("cpu", (gpus // args.cp_size, args.cp_size), mesh_dim_names=("dp", "cp"))
    if chapter == "09-expert-parallel":  # each shard group's ranks split into groups of ep
        argv += ["--ep-size", str(args.ep_size)]
        names = ("replicate", "efsdp", "ep")
        expert_mesh = init_device_mesh("cpu", (dp // shard, shard // args.ep_size, args.ep_size), mesh_dim_names=names)
        for dims in ["ep", "efsdp", ("replicate", "efsdp")]:
            expert_mesh[dims].get_coordinate()
    config = AutoConfig.from_pretrained(args.model)
    peak = tracked_peak(load(chapter), config, mesh, argv, cp_mesh, expert_mesh)
    dist.destroy_process_group()

    layout = Layout("asked", gpus, args.tp_size, True, args.activation_checkpointing, args.shard_size,
                    args.gpus_per_node, cp=args.cp_size, ep=args.ep_size)  # fmt: skip
    planned = plan(count(args.model), layout, args.batch_size, args.seq_length, 2, False, compiled=False)
    print(f"{args.model}, chapter {chapter[:2]} on {args.nodes} x {args.gpus_per_node} GPUs, {' '.join(argv)}")
    print("GiB per GPU at the step's peak   measured (FSDPMemTracker)   planned (tools.plan, not compiled)")
    rows = [
        ("weights", peak["Sharded Param"], planned["weights"] / GIB),
        ("gradients", peak["Sharded Grad"] + peak["Unsharded Grad"], planned["gradients"] / GIB),
        ("optimizer", peak["OptState"], planned["optimizer"] / GIB),
        ("gathered", peak["Unsharded Param"], planned["gathered"] / GIB),
        ("activations", peak["Activation"] + peak["Temp"] + peak["Inputs"] + peak["Buffer"],
         (planned["activations"] + planned["loss backward"]) / GIB),
        ("total", peak["Total"], planned["total"] / GIB),
    ]  # fmt: skip
    for name, measured, predicted in rows:
        print(f"  {name:<30} {measured:10.2f} {predicted:27.2f}")
    print("measured, by FSDPMemTracker's kinds: " + ", ".join(f"{kind} {gib:.2f}" for kind, gib in peak.items()))


def main_composed(args) -> None:
    """Chapter 10 (--pp-size, or --tp-size with --cp-size; --ep-size for a mixture of experts): its
    step on rank 0 (the first stage's), the last stage's first rank or --pp-rank's, beside the
    planner's figures for that stage."""
    from transformers import AutoConfig

    gpus = args.nodes * args.gpus_per_node
    argv = ["--batch-size", str(args.batch_size), "--seq-length", str(args.seq_length)]
    argv += ["--grad-accum-steps", str(args.grad_accum_steps), "--pp-size", str(args.pp_size)]
    argv += ["--tp-size", str(args.tp_size), "--cp-size", str(args.cp_size), "--pp-schedule", args.pp_schedule]
    argv += ["--ep-size", str(args.ep_size)] if args.ep_size > 1 else []
    argv += ["--shard-size", str(args.shard_size)] if args.shard_size else []
    argv += ["--activation-checkpointing", args.activation_checkpointing] if args.activation_checkpointing else []
    pp_rank = args.pp_rank if args.pp_rank is not None else args.pp_size - 1 if args.last_stage else 0
    rank = pp_rank * gpus // args.pp_size
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(args.gpus_per_node))  # torchrun's, which 05's check reads
    dist.init_process_group("fake", rank=rank, world_size=gpus)  # given no store, it makes its own
    started = time.perf_counter()
    peak = composed_peak(load("10-nd-parallel"), AutoConfig.from_pretrained(args.model), argv, gpus)
    seconds = time.perf_counter() - started
    dist.destroy_process_group()
    layout = Layout("asked", gpus, args.tp_size, True, args.activation_checkpointing, args.shard_size,
                    args.gpus_per_node, cp=args.cp_size, pp=args.pp_size, schedule=args.pp_schedule,
                    ep=args.ep_size)  # fmt: skip
    planned = plan(count(args.model), layout, args.batch_size, args.seq_length, 2, False, compiled=False)
    planned = planned["stages"][pp_rank] if args.pp_size > 1 else planned
    stage = "first stage" if pp_rank == 0 else "last stage" if pp_rank == args.pp_size - 1 else f"stage {pp_rank}"
    print(f"{args.model}, chapter 10 on {args.nodes} x {args.gpus_per_node} GPUs, rank {rank} ({stage}), "
          f"{' '.join(argv)}: {seconds:.0f} s")  # fmt: skip
    print("GiB per GPU at the step's peak   measured (FSDPMemTracker)   planned (tools.plan, not compiled)")
    rows = [
        ("weights and optimizer", peak["Sharded Param"] + peak["OptState"],
         (planned["weights"] + planned["optimizer"]) / GIB),
        ("gradients", peak["Sharded Grad"] + peak["Unsharded Grad"], planned["gradients"] / GIB),
        ("gathered", peak["Unsharded Param"], planned["gathered"] / GIB),
        ("activations", peak["Activation"] + peak["Temp"] + peak["Inputs"] + peak["Buffer"],
         (planned["activations"] + planned["loss backward"]) / GIB),
        ("total", peak["Total"], planned["total"] / GIB),
    ]  # fmt: skip
    for name, measured, predicted in rows:
        print(f"  {name:<30} {measured:10.2f} {predicted:27.2f}")
    print("measured, by FSDPMemTracker's kinds: " + ", ".join(f"{kind} {gib:.2f}" for kind, gib in peak.items()))
    if args.pp_size > 1:  # PipelineStage holds FSDP's reduce back to the last micro-batch
        print("(FSDPMemTracker counts a pipeline's gradients, accumulated whole over the micro-batches, as Temp: "
              "above, in activations)")  # fmt: skip


if __name__ == "__main__":
    main()

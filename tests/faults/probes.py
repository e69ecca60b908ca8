"""Measurement probes: the PROBE_* switches of the table in sitecustomize.py, which imports this module
in every process the tests launch, before faults.py. They change nothing the script computes, and
nothing is imported or replaced unless a switch is set. They hook the optimizer step through torch's
global step hooks, in the order of the table; the probes that need each DDP model share one wrapper
of DistributedDataParallel.__init__ (`after_ddp_init`)."""

import json
import os
from pathlib import Path

RANK_0 = os.environ.get("RANK", "0") == "0"

_ddp_callbacks = []  # called with each DDP model once made, in the order they were added


def after_ddp_init(callback) -> None:
    """Calls `callback(model)` after every DistributedDataParallel(...): its __init__ is wrapped once,
    on the first call, for every probe."""
    if not _ddp_callbacks:
        from torch.nn.parallel import DistributedDataParallel

        ddp_init = DistributedDataParallel.__init__

        def ddp_init_then_callbacks(self, *args, **kwargs):
            ddp_init(self, *args, **kwargs)
            for each in _ddp_callbacks:
                each(self)

        DistributedDataParallel.__init__ = ddp_init_then_callbacks
    _ddp_callbacks.append(callback)


def compile_counts(path: str, backend: str) -> None:
    """Counts what torch.compile hands its backend (`backend`: inductor, or eager in the CPU tests), the
    same way in every torch version: dynamo's own counters moved between versions (counters["frames"]
    ["total"] stayed 0 with torch 2.13 on the CPU and torch 2.11 on an H100, though compile was on)."""
    import functools

    import torch
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters
    from torch.optim.optimizer import register_optimizer_step_post_hook

    # Per graph dynamo compiled (by its compile id: DDP's optimizer hands the backend one graph in pieces, one per
    # bucket), the context_fn of each checkpoint region (None: full), in the order traced.
    graphs = {}

    def recording_backend(gm, example_inputs):
        regions = graphs.setdefault(str(torch._guards.CompileContext.current_compile_id()), [])
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is torch.ops.higher_order.tag_activation_checkpoint:
                context_fn = getattr(gm, node.args[0].target).meta.get("_checkpoint_context_fn")
                regions.append(getattr(context_fn, "__name__", None))
        return lookup_backend(backend)(gm, example_inputs)

    torch.compile = functools.partial(torch.compile, backend=recording_backend)

    def after_step(optimizer, args, kwargs):
        counts = {"graphs": len(graphs), "graph_breaks": sum(counters["graph_break"].values()),
                  "checkpoints": list(graphs.values())}  # fmt: skip
        with open(path, "a") as f:
            f.write(json.dumps(counts) + "\n")

    register_optimizer_step_post_hook(after_step)


def state_bytes(path: Path) -> None:
    from torch.distributed.tensor import DTensor
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    ddp_models = []
    after_ddp_init(ddp_models.append)
    measuring = {}  # what the first step measured before it ran

    def storage_bytes(tensors):
        storages = {}
        for tensor in tensors:
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def before_step(optimizer, args, kwargs):
        if path.exists():  # measured at the first step
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        gradients = storage_bytes(p.grad for p in params if p.grad is not None)
        # DDP copies the gradients into its own buckets to all-reduce them ("bucket_sizes": bytes).
        for model in ddp_models:
            gradients += sum(int(size) for size in model._get_ddp_logging_data()["bucket_sizes"].split(","))
        measuring.update(params=params, gradients=gradients)

    def after_step(optimizer, args, kwargs):
        if not measuring:
            return
        moments = [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]  # not `step`
        measured = {
            "weights": storage_bytes(measuring["params"]),
            "gradients": measuring["gradients"],
            "optimizer": storage_bytes(moments),
        }
        path.write_text(json.dumps(measured))
        measuring.clear()

    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)


def gradient_reductions(path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    reductions = {"ddp_buckets": [], "reduce_scatters": 0, "replica_all_reduces": 0}

    def counting_allreduce_hook(state, bucket):
        reductions["ddp_buckets"].append(bucket.index())
        return allreduce_hook(state, bucket)

    after_ddp_init(lambda model: model.register_comm_hook(None, counting_allreduce_hook))

    def counting(reduce_scatter):
        def counting_reduce_scatter(*args, **kwargs):
            reductions["reduce_scatters"] += 1
            return reduce_scatter(*args, **kwargs)

        return counting_reduce_scatter

    # FSDP calls one or the other, by version: torch 2.13's calls reduce_scatter_single.
    for name in ["reduce_scatter_tensor", "reduce_scatter_single"]:
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name)))

    all_reduce = dist.all_reduce

    def counting_all_reduce(*args, group=None, **kwargs):
        # HSDP's, between replicas, name their group; the chapters' own (the loss, a stop) use the default.
        reductions["replica_all_reduces"] += group is not None
        return all_reduce(*args, group=group, **kwargs)

    dist.all_reduce = counting_all_reduce

    def before_step(optimizer, args, kwargs):
        with open(path, "a") as f:
            f.write(json.dumps(reductions) + "\n")
        reductions.update(ddp_buckets=[], reduce_scatters=0, replica_all_reduces=0)

    register_optimizer_step_pre_hook(before_step)


def host_syncs(path: str) -> None:
    """What a GPU would wait for: every read of a tensor's value by the host (.item(), float(t), `if t:`,
    an f-string) and every tensor made from host data (torch.tensor), that a line of the repository's
    own code makes, by step: the line, and the steps finished before it."""
    import atexit
    import sys

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils._python_dispatch import TorchDispatchMode

    repo = str(Path(__file__).resolve().parents[2]) + os.sep
    watched = {torch.ops.aten._local_scalar_dense.default: "read", torch.ops.aten.lift_fresh.default: "from host"}
    # Frames between the line that asks and the dispatch: a tensor's dunder methods, dynamo's wrapper.
    passing = ("torch/_tensor.py", "torch/_compile.py", "torch/_dynamo/eval_frame.py")
    steps, events = [0], []

    class HostSyncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in watched:
                frame = sys._getframe(1)
                while frame.f_code.co_filename.endswith(passing):
                    frame = frame.f_back
                where = frame.f_code.co_filename
                if where.startswith(repo):
                    events.append(f"{watched[func]} {where[len(repo):]}:{frame.f_lineno} {frame.f_code.co_name}")
            return func(*args, **(kwargs or {}))

    def write():
        with open(path, "a") as f:
            f.write(json.dumps({"steps_finished": steps[0], "events": events}) + "\n")
        events.clear()

    def after_step(optimizer, args, kwargs):
        write()  # what happened since the step before finished: its bookkeeping, and this step
        steps[0] += 1

    register_optimizer_step_post_hook(after_step)
    atexit.register(lambda: steps[0] and write())  # the last step's bookkeeping, the end's evaluation and save
    HostSyncs().__enter__()  # for the whole run, on the training thread


def max_steps(cap: int) -> None:
    """A chapter's run stops after `cap` steps, as with --max-steps `cap` (or its own, if fewer): its schedule,
    evaluation and checkpoint at the last step, and a rerun resumes a finished run, as users' runs do. Its
    evaluations take at most `cap` batches too, as with --eval-batches `cap` (the default's 20 cost a
    2-rank run of the tiny default more CPU time than its steps)."""
    import argparse

    parse_args = argparse.ArgumentParser.parse_args

    def capped(self, *args, **kwargs):
        namespace = parse_args(self, *args, **kwargs)
        if hasattr(namespace, "max_steps"):
            namespace.max_steps = min(namespace.max_steps or cap, cap)
        if hasattr(namespace, "eval_batches"):
            namespace.eval_batches = min(namespace.eval_batches, cap)
        return namespace

    argparse.ArgumentParser.parse_args = capped


def count_steps(path: str) -> None:
    """A line in `path` for every training step that rank 0 finishes: an optimizer step after a backward
    (DCP's resume runs one on zero gradients to make the optimizer's state: not training)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    since_step = {"backward": False}

    def counted(backward):  # torch.autograd.backward (loss.backward() calls it) or .grad (a pipeline stage's)
        def counted_backward(*args, **kwargs):
            since_step["backward"] = True
            return backward(*args, **kwargs)

        return counted_backward

    def after_step(optimizer, args, kwargs):
        if since_step["backward"]:
            with open(path, "a") as f:
                f.write(f"{os.getpid()}\n")
        since_step["backward"] = False

    torch.autograd.backward, torch.autograd.grad = counted(torch.autograd.backward), counted(torch.autograd.grad)
    register_optimizer_step_post_hook(after_step)


def expert_counts(folder: str) -> None:
    """At every call of Qwen3-MoE's experts in a training forward (not evaluation's, nor checkpointing's
    recompute), the tokens the router sent to each expert, a JSON line in folder/expert-counts-rank-R.jsonl:
    the layers in order. A forward pre-hook on each experts module, which runs whatever replaced its forward
    (chapter 09's dispatch) and whatever the router does (FAULT_EXPERTS_UNUSED_FROM)."""
    import torch
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    path = Path(folder) / f"expert-counts-rank-{os.environ.get('RANK', '0')}.jsonl"
    init = modeling_qwen3_moe.Qwen3MoeExperts.__init__

    def counting_init(self, config, *args, **kwargs):
        init(self, config, *args, **kwargs)

        def count(module, inputs):
            if module.training and torch._C._current_graph_task_id() == -1:
                counts = torch.bincount(inputs[1].flatten(), minlength=config.num_experts).tolist()
                with path.open("a") as file:
                    file.write(json.dumps(counts) + "\n")

        self.register_forward_pre_hook(count)

    modeling_qwen3_moe.Qwen3MoeExperts.__init__ = counting_init


if RANK_0 and "PROBE_COMPILE_COUNTS" in os.environ:
    compile_counts(os.environ["PROBE_COMPILE_COUNTS"], os.environ.get("PROBE_COMPILE_BACKEND", "inductor"))
elif "PROBE_COMPILE_BACKEND" in os.environ:
    import functools

    import torch

    torch.compile = functools.partial(torch.compile, backend=os.environ["PROBE_COMPILE_BACKEND"])
if RANK_0:
    if "PROBE_STATE_BYTES" in os.environ:
        state_bytes(Path(os.environ["PROBE_STATE_BYTES"]))
    if "PROBE_GRADIENT_REDUCTIONS" in os.environ:
        gradient_reductions(os.environ["PROBE_GRADIENT_REDUCTIONS"])
    if "PROBE_HOST_SYNCS" in os.environ:
        host_syncs(os.environ["PROBE_HOST_SYNCS"])
if "PROBE_SCALED_MM_SHAPES" in os.environ:
    import scaled_mm_shapes

    scaled_mm_shapes.install()
if "PROBE_DRY_RUN" in os.environ or "PROBE_DRY_RUN_BLOCKS" in os.environ:
    import dry_run

    if "PROBE_DRY_RUN_BLOCKS" in os.environ:
        dry_run.fewer_blocks(int(os.environ["PROBE_DRY_RUN_BLOCKS"]))
    if "PROBE_DRY_RUN" in os.environ:
        dry_run.install(os.environ["PROBE_DRY_RUN"])
if "PROBE_EXPERT_COUNTS" in os.environ:
    expert_counts(os.environ["PROBE_EXPERT_COUNTS"])
if "PROBE_MAX_STEPS" in os.environ:
    max_steps(int(os.environ["PROBE_MAX_STEPS"]))
if RANK_0 and "PROBE_STEPS" in os.environ:
    count_steps(os.environ["PROBE_STEPS"])

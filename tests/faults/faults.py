"""Fault injection: the FAULT_* switches of the table in sitecustomize.py, which imports this module
in every process the tests launch. Nothing is imported or replaced unless a switch is set."""

import os
import signal
from pathlib import Path

FIRST_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
RANK = os.environ.get("RANK", "0")
STEP_FAULTS = ["FAULT_RAISE_AT_STEP", "FAULT_KILL_AT_STEP", "FAULT_NAN_AT_STEP", "FAULT_SIGNAL_AT_STEP"]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def kill_after_checkpoint(count: int) -> None:
    """Checkpoints are published by renaming their staging folder to step-*: die after the count-th."""
    replace = os.replace
    published = 0

    def replace_then_maybe_die(src, dst, *args, **kwargs):
        nonlocal published
        replace(src, dst, *args, **kwargs)
        if Path(dst).name.startswith("step-"):
            published += 1
            if published == count:
                die()

    os.replace = replace_then_maybe_die


def kill_during_checkpoint(count: int) -> None:
    import io

    import torch

    save = torch.save
    staging_dirs = []

    def save_or_die_half_way(obj, f, *args, **kwargs):
        parent = Path(f).parent if isinstance(f, (str, os.PathLike)) else None
        if parent is not None and parent.name.endswith(".tmp"):
            if parent not in staging_dirs:
                staging_dirs.append(parent)
            # The second file of the count-th checkpoint: one file complete, this one cut in half.
            if len(staging_dirs) == count and any(parent.iterdir()):
                buffer = io.BytesIO()
                save(obj, buffer, *args, **kwargs)
                Path(f).write_bytes(buffer.getvalue()[: buffer.tell() // 2])
                die()
        return save(obj, f, *args, **kwargs)

    torch.save = save_or_die_half_way


def kill_during_shard_write(count: int) -> None:
    """DCP writes each rank's shards item by item (filesystem._write_item): die after the first item
    of this rank's count-th save, with --async-checkpoints in the thread that writes it."""
    from torch.distributed.checkpoint import filesystem

    write_item = filesystem._write_item
    saves = []

    def write_item_or_die(transforms, stream, *args, **kwargs):
        result = write_item(transforms, stream, *args, **kwargs)
        folder = Path(stream.name).parent
        if folder not in saves:
            saves.append(folder)
            if len(saves) == count:
                stream.flush()
                die()
        return result

    filesystem._write_item = write_item_or_die


def kill_during_export() -> None:
    """An export's merge (torch's consolidation of the ranks' shards into the published files): die
    right after this rank has merged its files, before the others have published the folder."""
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidation

    merge = consolidation._consolidate_safetensors_files

    def merge_then_die(*args, **kwargs):
        merge(*args, **kwargs)
        die()

    consolidation._consolidate_safetensors_files = merge_then_die


def when_imported(name: str, patch) -> None:
    """Calls `patch(module)` once the chapter has imported its module `name` (common.published, or
    a module beside its script: not importable before the chapter puts its folder on the path)."""
    import importlib.abc
    import sys

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            exec_module = spec.loader.exec_module

            def exec_and_patch(module):
                exec_module(module)
                patch(module)

            spec.loader.exec_module = exec_and_patch
            return spec

    import importlib.util

    sys.meta_path.insert(0, Finder())


def kill_during_export_publish(count: int) -> None:
    """Die before the count-th step of putting a finished export in an earlier one's place
    (published.replace_export): a swap of the folders, a rename, the earlier export's removal."""
    import shutil
    import types

    def patch(published):
        steps, replacing = 0, False

        def step(function):
            def counted(*args, **kwargs):
                nonlocal steps
                steps += replacing
                if replacing and steps == count:
                    die()
                return function(*args, **kwargs)

            return counted

        replace_export = published.replace_export

        def replace_export_counting(tmp, final):
            nonlocal replacing
            replacing = final.exists()  # an earlier export there
            replace_export(tmp, final)

        published.replace_export = replace_export_counting
        published.swap_folders = step(published.swap_folders)
        published.os = types.SimpleNamespace(**{**vars(os), "replace": step(os.replace)})
        published.shutil = types.SimpleNamespace(**{**vars(shutil), "rmtree": step(shutil.rmtree)})

    when_imported("common.published", patch)


def no_rename_exchange() -> None:
    """A file system that cannot swap two folders (NFS): published.swap_folders always declines."""
    when_imported("common.published", lambda published: setattr(published, "swap_folders", lambda a, b: False))


def slow_shard_writes(seconds: float) -> None:
    import time

    from torch.distributed.checkpoint import filesystem

    write_files = filesystem._write_files_from_queue

    def slow_write_files(*args, **kwargs):
        time.sleep(seconds)
        return write_files(*args, **kwargs)

    filesystem._write_files_from_queue = slow_write_files


def late_release_at_exit(folder: str) -> None:
    """A gloo worker lets go of a collective's tensor after the rank's main thread has ended the run:
    what a descheduled worker on a loaded machine does by chance (issue: SIGABRT after "Done"), made
    certain. At the run's destroy_process_group, every rank all-reduces a tensor of its own, over a group
    that outlives the call (as the groups of a DeviceMesh in DTensor's caches do), and keeps no reference
    to it: the worker lets go of it last, and Python calls back (weakref) in that thread. Rank 1's worker
    holds the work before rank 0 joins it, so that its main thread has dropped it first. The callback
    says in `folder` which thread ran it, then sleeps, with the GIL released, until the interpreter shuts
    down (at most 20 s): its next take of the GIL then aborts the process, unless the run ends without
    Python's shutdown."""
    import sys
    import threading
    import time
    import weakref

    import torch
    import torch.distributed as dist

    destroy = dist.destroy_process_group
    held = []

    def destroy_after_a_late_release(group=None):
        if group is not None or held:
            return destroy(group)
        held.append(dist.new_group(backend="gloo"))
        released = threading.Event()

        def in_the_releasing_thread(_):
            main = threading.current_thread() is threading.main_thread()
            Path(folder, f"late-release-rank-{RANK}.txt").write_text("main thread" if main else "gloo worker")
            released.set()
            deadline = time.monotonic() + 20
            while not main and not sys.is_finalizing() and time.monotonic() < deadline:
                time.sleep(0.01)

        tensor = torch.ones(1)
        held.append(weakref.ref(tensor, in_the_releasing_thread))  # kept: a dead reference calls nothing
        if RANK == "0":
            time.sleep(0.2)
        dist.all_reduce(tensor, group=held[0], async_op=True)  # no reference kept to the work either
        del tensor
        assert released.wait(60), "the late-released tensor was never released"
        dist.barrier()  # every rank's all-reduce has ended: none exits while a peer still sends
        return destroy()

    dist.destroy_process_group = destroy_after_a_late_release


def strike_at_step(fault: str, fault_step: int) -> None:
    """One of STEP_FAULTS, through torch's global optimizer step hooks (registered after the probes')."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    steps = 0

    def before_step(optimizer, args, kwargs):
        nonlocal steps
        steps += 1
        if steps != fault_step:
            return
        if fault == "FAULT_KILL_AT_STEP":
            die()
        if fault == "FAULT_RAISE_AT_STEP":
            raise RuntimeError(f"injected fault at step {steps}")
        if fault == "FAULT_SIGNAL_AT_STEP":  # the step goes on; the signal's handler runs meanwhile
            target = os.getppid() if os.environ.get("FAULT_SIGNAL_PARENT") else os.getpid()
            os.kill(target, getattr(signal, "SIG" + os.environ.get("FAULT_SIGNAL", "TERM")))

    def after_step(optimizer, args, kwargs):
        if steps == fault_step:  # FAULT_NAN_AT_STEP
            with torch.no_grad():
                optimizer.param_groups[0]["params"][0].fill_(float("nan"))

    register_optimizer_step_pre_hook(before_step)
    if fault == "FAULT_NAN_AT_STEP":
        register_optimizer_step_post_hook(after_step)


def slow_data(seconds: float) -> None:
    import time

    import common
    import common.data

    load_and_pack = common.data.load_and_pack

    def slow_load_and_pack(*args, **kwargs):
        time.sleep(seconds)
        return load_and_pack(*args, **kwargs)

    common.load_and_pack = common.data.load_and_pack = slow_load_and_pack


def slow_matmuls(seconds: float) -> None:
    """A throttled GPU, as python -m tools.preflight measures it: every torch.matmul takes S seconds more."""
    import time

    import torch

    matmul = torch.matmul

    def slow_matmul(*args, **kwargs):
        time.sleep(seconds)
        return matmul(*args, **kwargs)

    torch.matmul = slow_matmul


def slow_batches(seconds: float) -> None:
    """A slow data path (disk, file system, busy CPUs): every batch a DataLoader yields takes S seconds more."""
    import time

    from torch.utils.data import dataloader

    next_batch = dataloader._BaseDataLoaderIter.__next__

    def slow_next(self):
        time.sleep(seconds)
        return next_batch(self)

    dataloader._BaseDataLoaderIter.__next__ = slow_next


def slow_blocks(seconds: float) -> None:
    """A slow GPU, in the forward compute: every Llama block's forward takes S seconds more. Under FSDP the
    block's all-gather comes before it (in FSDP's hook), so the other ranks wait for it in their forward."""
    import time

    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaDecoderLayer.forward

    def slow_forward(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    modeling_llama.LlamaDecoderLayer.forward = slow_forward


def experts_unused_from(first: int) -> None:
    """Qwen3-MoE's routers never choose experts `first` and above (their logits -inf): under expert
    parallelism, the ranks that hold only those receive no tokens. The same objective in every chapter."""
    import torch
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def forward(self, hidden_states):  # Qwen3MoeTopKRouter.forward (transformers 5), with the mask
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        logits = logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= first, float("-inf"))
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top_value, top_index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_value /= top_value.sum(dim=-1, keepdim=True)
        return logits, top_value.to(logits.dtype), top_index

    modeling_qwen3_moe.Qwen3MoeTopKRouter.forward = forward


def wrong_fp8_scales(factor: float) -> None:
    # The two places torchao computes a scale from an amax; the chapter imports the second by name
    # after this runs, so replacing it in torchao.float8 is enough.
    import torchao.float8
    from torchao.float8 import float8_utils

    amax_to_scale = float8_utils.amax_to_scale
    precompute = torchao.float8.precompute_float8_dynamic_scale_for_fsdp

    def wrong_amax_to_scale(*args, **kwargs):
        return amax_to_scale(*args, **kwargs) * factor

    def wrong_precompute(module):
        precompute(module)
        for parameter in module.parameters():
            local = getattr(parameter, "_local_tensor", None)
            if getattr(local, "_precomputed_scale", None) is not None:
                local._precomputed_scale = local._precomputed_scale * factor

    float8_utils.amax_to_scale = wrong_amax_to_scale
    torchao.float8.precompute_float8_dynamic_scale_for_fsdp = wrong_precompute


if FIRST_ATTEMPT:
    if "FAULT_KILL_AFTER_CHECKPOINT" in os.environ:
        kill_after_checkpoint(int(os.environ["FAULT_KILL_AFTER_CHECKPOINT"]))
    if "FAULT_KILL_DURING_CHECKPOINT" in os.environ:
        kill_during_checkpoint(int(os.environ["FAULT_KILL_DURING_CHECKPOINT"]))
    if "FAULT_KILL_DURING_SHARD_WRITE" in os.environ and RANK == os.environ.get("FAULT_RANK", "0"):
        kill_during_shard_write(int(os.environ["FAULT_KILL_DURING_SHARD_WRITE"]))
    if "FAULT_KILL_DURING_EXPORT" in os.environ and RANK == os.environ.get("FAULT_RANK", "0"):
        kill_during_export()
    if "FAULT_KILL_DURING_EXPORT_PUBLISH" in os.environ and RANK == "0":
        kill_during_export_publish(int(os.environ["FAULT_KILL_DURING_EXPORT_PUBLISH"]))
    step_fault = next((name for name in STEP_FAULTS if name in os.environ), None)
    if step_fault and RANK == os.environ.get("FAULT_RANK", "0"):
        strike_at_step(step_fault, int(os.environ[step_fault]))
    if "FAULT_FP8_SCALE" in os.environ:
        wrong_fp8_scales(float(os.environ["FAULT_FP8_SCALE"]))
if "FAULT_NO_RENAME_EXCHANGE" in os.environ:
    no_rename_exchange()
if "FAULT_EXPERTS_UNUSED_FROM" in os.environ:
    experts_unused_from(int(os.environ["FAULT_EXPERTS_UNUSED_FROM"]))
if "FAULT_LATE_RELEASE_AT_EXIT" in os.environ:
    late_release_at_exit(os.environ["FAULT_LATE_RELEASE_AT_EXIT"])
if "FAULT_SLOW_DATA" in os.environ and RANK == "0":
    slow_data(float(os.environ["FAULT_SLOW_DATA"]))
if "FAULT_SLOW_SHARD_WRITE" in os.environ and RANK == os.environ.get("FAULT_RANK", "0"):
    slow_shard_writes(float(os.environ["FAULT_SLOW_SHARD_WRITE"]))
if "FAULT_SLOW_MATMUL" in os.environ and RANK == os.environ.get("FAULT_RANK", "0"):
    slow_matmuls(float(os.environ["FAULT_SLOW_MATMUL"]))
if "FAULT_SLOW_BATCH" in os.environ and RANK == os.environ.get("FAULT_RANK", "0"):
    slow_batches(float(os.environ["FAULT_SLOW_BATCH"]))
if "FAULT_SLOW_BLOCK" in os.environ and RANK == os.environ.get("FAULT_RANK", "0"):
    slow_blocks(float(os.environ["FAULT_SLOW_BLOCK"]))

"""Test-only fault injection. Python imports this file at the start of every process the tests
launch (tests/harness.py's chapter_env puts its folder on PYTHONPATH), so the training scripts carry
no test hooks. Each fault is chosen by an environment variable:

FAULT_KILL_AFTER_CHECKPOINT=N   SIGKILL this process right after its N-th checkpoint is published.
FAULT_KILL_DURING_CHECKPOINT=N  SIGKILL this process half-way through a file of its N-th checkpoint.
FAULT_RAISE_AT_STEP=N           raise in the N-th optimizer step, on the rank FAULT_RANK (default 0).
FAULT_KILL_AT_STEP=N            SIGKILL in the N-th optimizer step, on the rank FAULT_RANK (default 0).
FAULT_NAN_AT_STEP=N             after the N-th optimizer step of rank FAULT_RANK, a weight becomes NaN.
FAULT_SIGNAL_AT_STEP=N          in the N-th optimizer step of rank FAULT_RANK, send FAULT_SIGNAL (default
                                TERM) to this process, or with FAULT_SIGNAL_PARENT=1 to its parent
                                (torchrun): as a scheduler would, at a step boundary that tests can name.
FAULT_SLOW_DATA=S               rank 0 prepares the data (load_and_pack) S seconds more slowly.
FAULT_FP8_SCALE=F               every FP8 scale torchao computes is F x the right one: in amax_to_scale (inputs,
                                output gradients, weights cast one by one) and in the weight scales
                                precompute_float8_dynamic_scale_for_fsdp sets for FSDP's FP8 all-gathers. The FP8
                                tensor keeps that scale, so with F > 1 every value above amax / F clamps.

A fault strikes once: when torchrun restarts the workers (TORCHELASTIC_RESTART_COUNT > 0), none is armed.

Probes, which change nothing the script computes:

PROBE_COMPILE_COUNTS=path       after every optimizer step of rank 0, append to `path` a JSON line
                                with the frames dynamo has looked at so far, the graphs it has
                                compiled (a recompile adds a graph) and its graph breaks.
PROBE_STATE_BYTES=path          at the first optimizer step of rank 0, write to `path` a JSON object
                                with the bytes of its weights, gradients (DDP's all-reduce buckets
                                included) and AdamW's moments: each storage once, a sharded tensor
                                (DTensor) by its local piece. What python -m tools.plan predicts.
PROBE_SCALED_MM_SHAPES=1        every emulated FP8 matmul (torchao, --fp8-emulate) first runs torch._scaled_mm
                                on meta tensors of its operands: fails where an H100's kernel would, on shapes
                                (scaled_mm_shapes.py).
PROBE_COMPILE_BACKEND=eager     torch.compile traces with dynamo as usual, then runs the traced graphs
                                as they are instead of generating kernels: what was traced, and how
                                often, is the same, in seconds instead of minutes on a small CPU.
"""

import gc
import os
import signal
from pathlib import Path

# No garbage collection during the imports: torch, transformers and datasets make ~370k objects that
# the collector would scan again and again, 10% of the suite's CPU time. Every chapter calls
# gc.freeze() in main once its imports are done; from there on it collects as it does for users.
gc.disable()
_gc_freeze = gc.freeze


def _freeze_then_collect():
    _gc_freeze()
    gc.enable()


gc.freeze = _freeze_then_collect


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


_first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
_this_rank = os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0")

if "FAULT_KILL_AFTER_CHECKPOINT" in os.environ and _first_attempt:
    _kill_after = int(os.environ["FAULT_KILL_AFTER_CHECKPOINT"])
    _published = 0
    _replace = os.replace

    def _replace_then_maybe_die(src, dst, *args, **kwargs):
        global _published
        _replace(src, dst, *args, **kwargs)
        if Path(dst).name.startswith("step-"):
            _published += 1
            if _published == _kill_after:
                _die()

    os.replace = _replace_then_maybe_die

if "FAULT_KILL_DURING_CHECKPOINT" in os.environ and _first_attempt:
    import io

    import torch

    _kill_during = int(os.environ["FAULT_KILL_DURING_CHECKPOINT"])
    _staging_dirs = []
    _save = torch.save

    def _save_or_die_half_way(obj, f, *args, **kwargs):
        parent = Path(f).parent if isinstance(f, (str, os.PathLike)) else None
        if parent is not None and parent.name.endswith(".tmp"):
            if parent not in _staging_dirs:
                _staging_dirs.append(parent)
            # The second file of the N-th checkpoint: one file complete, this one cut in half.
            if len(_staging_dirs) == _kill_during and any(parent.iterdir()):
                buffer = io.BytesIO()
                _save(obj, buffer, *args, **kwargs)
                Path(f).write_bytes(buffer.getvalue()[: buffer.tell() // 2])
                _die()
        return _save(obj, f, *args, **kwargs)

    torch.save = _save_or_die_half_way

_step_fault = next(
    (
        k
        for k in ["FAULT_RAISE_AT_STEP", "FAULT_KILL_AT_STEP", "FAULT_NAN_AT_STEP", "FAULT_SIGNAL_AT_STEP"]
        if k in os.environ
    ),
    None,
)
if _step_fault and _first_attempt and _this_rank:
    import torch

    _fault_step = int(os.environ[_step_fault])
    _adamw_step = torch.optim.AdamW.step
    _steps = 0

    def _step_or_fail(self, *args, **kwargs):
        global _steps
        _steps += 1
        if _steps != _fault_step:
            return _adamw_step(self, *args, **kwargs)
        if _step_fault == "FAULT_KILL_AT_STEP":
            _die()
        if _step_fault == "FAULT_RAISE_AT_STEP":
            raise RuntimeError(f"injected fault at step {_steps}")
        if _step_fault == "FAULT_SIGNAL_AT_STEP":
            import signal

            target = os.getppid() if os.environ.get("FAULT_SIGNAL_PARENT") else os.getpid()
            os.kill(target, getattr(signal, "SIG" + os.environ.get("FAULT_SIGNAL", "TERM")))
            return _adamw_step(self, *args, **kwargs)
        result = _adamw_step(self, *args, **kwargs)
        with torch.no_grad():  # FAULT_NAN_AT_STEP
            self.param_groups[0]["params"][0].fill_(float("nan"))
        return result

    torch.optim.AdamW.step = _step_or_fail

if "FAULT_SLOW_DATA" in os.environ and os.environ.get("RANK", "0") == "0":
    import time

    import common
    import common.data

    _load_and_pack = common.data.load_and_pack

    def _slow_load_and_pack(*args, **kwargs):
        time.sleep(float(os.environ["FAULT_SLOW_DATA"]))
        return _load_and_pack(*args, **kwargs)

    common.load_and_pack = common.data.load_and_pack = _slow_load_and_pack

if "FAULT_FP8_SCALE" in os.environ and _first_attempt:
    # The two places torchao computes a scale from an amax; the chapter imports the second by name
    # after this runs, so replacing it in torchao.float8 is enough.
    import torchao.float8
    from torchao.float8 import float8_utils

    _fp8_scale_factor = float(os.environ["FAULT_FP8_SCALE"])
    _amax_to_scale = float8_utils.amax_to_scale
    _precompute = torchao.float8.precompute_float8_dynamic_scale_for_fsdp

    def _wrong_amax_to_scale(*args, **kwargs):
        return _amax_to_scale(*args, **kwargs) * _fp8_scale_factor

    def _wrong_precompute(module):
        _precompute(module)
        for parameter in module.parameters():
            local = getattr(parameter, "_local_tensor", None)
            if getattr(local, "_precomputed_scale", None) is not None:
                local._precomputed_scale = local._precomputed_scale * _fp8_scale_factor

    float8_utils.amax_to_scale = _wrong_amax_to_scale
    torchao.float8.precompute_float8_dynamic_scale_for_fsdp = _wrong_precompute

if "PROBE_COMPILE_COUNTS" in os.environ and os.environ.get("RANK", "0") == "0":
    import json

    import torch
    from torch._dynamo.utils import counters

    _probe_path = os.environ["PROBE_COMPILE_COUNTS"]
    _probed_step = torch.optim.AdamW.step

    def _step_and_count(self, *args, **kwargs):
        result = _probed_step(self, *args, **kwargs)
        with open(_probe_path, "a") as f:
            f.write(
                json.dumps(
                    {
                        "frames": counters["frames"]["total"],
                        "graphs": counters["stats"]["unique_graphs"],
                        "graph_breaks": sum(counters["graph_break"].values()),
                    }
                )
                + "\n"
            )
        return result

    torch.optim.AdamW.step = _step_and_count

if "PROBE_SCALED_MM_SHAPES" in os.environ:
    import scaled_mm_shapes

    scaled_mm_shapes.install()

if "PROBE_COMPILE_BACKEND" in os.environ:
    import functools

    import torch

    torch.compile = functools.partial(torch.compile, backend=os.environ["PROBE_COMPILE_BACKEND"])

if "PROBE_GRADIENT_REDUCTIONS" in os.environ and os.environ.get("RANK", "0") == "0":
    # The collectives that reduce gradients, per optimizer step (one JSON line each): the indices
    # of the buckets DDP all-reduces (through a comm hook that does what DDP does by default), and
    # the number of reduce-scatters FSDP issues.
    import json

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    _reductions = {"ddp_buckets": [], "reduce_scatters": 0}
    _reductions_path = os.environ["PROBE_GRADIENT_REDUCTIONS"]

    def _counting_allreduce_hook(state, bucket):
        _reductions["ddp_buckets"].append(bucket.index())
        return allreduce_hook(state, bucket)

    _ddp_init = DistributedDataParallel.__init__

    def _ddp_init_with_counting_hook(self, *args, **kwargs):
        _ddp_init(self, *args, **kwargs)
        self.register_comm_hook(None, _counting_allreduce_hook)

    DistributedDataParallel.__init__ = _ddp_init_with_counting_hook

    def _counting(reduce_scatter):
        def counting_reduce_scatter(*args, **kwargs):
            _reductions["reduce_scatters"] += 1
            return reduce_scatter(*args, **kwargs)

        return counting_reduce_scatter

    # FSDP calls one or the other, by version: torch 2.13's calls reduce_scatter_single.
    for _name in ["reduce_scatter_tensor", "reduce_scatter_single"]:
        if hasattr(dist, _name):
            setattr(dist, _name, _counting(getattr(dist, _name)))
    _counted_step = torch.optim.AdamW.step

    def _step_and_record(self, *args, **kwargs):
        with open(_reductions_path, "a") as f:
            f.write(json.dumps(_reductions) + "\n")
        _reductions.update(ddp_buckets=[], reduce_scatters=0)
        return _counted_step(self, *args, **kwargs)

    torch.optim.AdamW.step = _step_and_record

if "PROBE_STATE_BYTES" in os.environ and os.environ.get("RANK", "0") == "0":
    import json

    import torch
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    _state_bytes_path = Path(os.environ["PROBE_STATE_BYTES"])
    _ddp_models = []
    _ddp_init_for_bytes = DistributedDataParallel.__init__

    def _ddp_init_and_keep(self, *args, **kwargs):
        _ddp_init_for_bytes(self, *args, **kwargs)
        _ddp_models.append(self)

    DistributedDataParallel.__init__ = _ddp_init_and_keep

    def _storage_bytes(tensors):
        storages = {}
        for tensor in tensors:
            storage = (tensor.to_local() if isinstance(tensor, DTensor) else tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    _measured_step = torch.optim.AdamW.step

    def _step_and_measure(self, *args, **kwargs):
        if _state_bytes_path.exists():  # measured at the first step
            return _measured_step(self, *args, **kwargs)
        params = [p for group in self.param_groups for p in group["params"]]
        gradients = _storage_bytes(p.grad for p in params if p.grad is not None)
        # DDP copies the gradients into its own buckets to all-reduce them ("bucket_sizes": bytes).
        for model in _ddp_models:
            gradients += sum(int(size) for size in model._get_ddp_logging_data()["bucket_sizes"].split(","))
        result = _measured_step(self, *args, **kwargs)
        moments = [v for state in self.state.values() for v in state.values() if v.dim() > 0]  # not `step`
        measured = {"weights": _storage_bytes(params), "gradients": gradients, "optimizer": _storage_bytes(moments)}
        _state_bytes_path.write_text(json.dumps(measured))
        return result

    torch.optim.AdamW.step = _step_and_measure

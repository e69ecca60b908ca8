"""FP8 statistics of tensors split over ranks, for test_06_fp8.py: run under torchrun on 2 ranks (gloo),
rank 0 prints them as JSON. `fsdp`: the weights sharded by FSDP (FP8 all-gathers, precomputed scales);
`tp`: the layers split by TP, the second one's input and the first one's output gradient split by feature.
In both, the outliers sit in rank 0's pieces: scaled by rank 1's own amax, its pieces would underflow less."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "06-fp8"))  # chapter 06's own modules
from fp8_stats import Float8Stats  # noqa: E402


def model_and_input(fp8_all_gather: bool = False):
    torch.manual_seed(0)
    # Biases (zero): gloo cannot send FP8 bytes, but FSDP all-gathers a unit of mixed dtypes as bytes.
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 32))
    with torch.no_grad():
        for linear in model:
            linear.weight.normal_(std=1e-3)
            linear.bias.zero_()
            linear.weight[0, 0] = 10.0  # row 0: rank 0's shard under FSDP, rank 0's slice under TP
    x = torch.randn(16, 32) * 1e-3
    x[:, 0] = 100.0  # the first layer's output feature 0 (rank 0's half under TP) is large
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=fp8_all_gather)
    return convert_to_float8_training(model, config=config), x


def statistics(model, x, reduce=False) -> dict:
    stats = Float8Stats(model, torch.device("cpu"), reduce=reduce)
    stats.start(step=1)
    model(x).pow(2).sum().backward()
    return stats.stop()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    model, x = model_and_input(fp8_all_gather=sys.argv[1] == "fsdp")
    if sys.argv[1] == "fsdp":
        for linear in model:
            fully_shard(linear, mesh=mesh)
        fully_shard(model, mesh=mesh)
        precompute_float8_dynamic_scale_for_fsdp(model)
    else:
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    # Both ranks train on the same rows: every statistic is the single process's, combined or not.
    metrics = statistics(model, x, reduce=True)
    if dist.get_rank() == 0:
        print(json.dumps(metrics), flush=True)
    dist.destroy_process_group()
    # Gloo's worker thread frees the last all-reduce's tensors after the caller has gone on, and freeing
    # a tensor made in Python takes the GIL: once the interpreter is shutting down, that aborts the
    # process ("terminate called without an active exception", 1 run in ~50 on a loaded CPU; the gdb
    # stack: ~AsyncAllreduceWork in ProcessGroupGloo::runLoop, take_gil, pthread_exit in Py_FinalizeEx).
    # Nothing is left to do: leave without the interpreter's shutdown.
    os._exit(0)

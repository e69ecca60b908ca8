"""PROBE_DRY_RUN: a chapter's command for real hardware, run on one CPU through everything up to its
first optimizer step, then stopped: its flags and checks, its data (tokenized, packed, the batch checked
against the rows), the model built at its real shape, parallelized at its layout, and one step.

This process plays rank RANK of WORLD_SIZE (torchrun's variables, set by the test) on PyTorch's `fake`
process group: every collective returns at once, and the chapter's meshes, plans and FSDP are built as on
the cluster. From the first model the chapter builds, every tensor is a fake one (FakeTensorMode): shapes
and dtypes, no memory and no arithmetic, so that 8B or 70B parameters cost nothing. What needs values stays
real: the samplers' permutations; `--from-pretrained` builds from the config (a shape has no weights), and
chapters 04-09 skip each rank's read of its slices.
At the end of the first optimizer step it writes PROBE_DRY_RUN's file (what was built) and exits 0.
"""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def install(path: str) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.utils.data import DataLoader, RandomSampler
    from torch.utils.data.distributed import DistributedSampler
    from transformers import AutoConfig, AutoModelForCausalLM

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    built = {}

    def init_process_group(*args, timeout=None, **kwargs):
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        options = {"timeout": timeout} if timeout else {}
        # A store that keeps what is set: rank0_first waits on it (the fake one keeps nothing).
        dist.distributed_c10d.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size, **options)

    dist.init_process_group = init_process_group

    # Groups of another backend (--async-checkpoints' gloo group) on the fake one too: gloo would wait for peers.
    new_group = dist.new_group
    dist.new_group = lambda *args, backend=None, **kwargs: new_group(*args, **kwargs)

    # Python objects go through real tensors, which the fake group does not fill: every rank says what this one
    # says (the job's wandb id, rank 0's checkpoint, each rank's host).
    def all_gather_object(object_list, obj, group=None):
        object_list[:] = [obj] * len(object_list)

    dist.all_gather_object = all_gather_object
    dist.broadcast_object_list = lambda object_list, src=None, group=None, **kwargs: None

    from_config = AutoModelForCausalLM.from_config.__func__

    def fake_from_now():
        if "fake" not in built:
            built["fake"] = fake_mode.__enter__()

    def fake_from_config(cls, config, **kwargs):
        # The first model the chapter builds for real starts fake tensors: from here on, nothing is allocated.
        if torch.empty(0).device.type != "meta":
            fake_from_now()
        model = from_config(cls, config, **kwargs)
        built.setdefault("parameters", sum(p.numel() for p in model.parameters()))
        return model

    def fake_from_pretrained(cls, name, **kwargs):
        return fake_from_config(cls, AutoConfig.from_pretrained(name), **kwargs)

    AutoModelForCausalLM.from_config = classmethod(fake_from_config)
    AutoModelForCausalLM.from_pretrained = classmethod(fake_from_pretrained)

    # Chapters 04-09 allocate a --from-pretrained model's shards with to_empty(): fake from there on. The
    # published files are not here (the shape's folder stands in) and fake tensors hold no values: each
    # rank's read of its slices is skipped, and so are the buffers transformers computes on each rank.
    to_empty = torch.nn.Module.to_empty

    def fake_to_empty(self, *args, **kwargs):
        fake_from_now()
        return to_empty(self, *args, **kwargs)

    torch.nn.Module.to_empty = fake_to_empty
    import torch.distributed.checkpoint as dcp

    from common import published  # chapters 04-10's (01-03 do not import it)

    published.pretrained_weights = lambda model_name, config: Path(model_name)
    published.build_buffers = lambda model: None
    load = dcp.load

    def load_unless_published(state_dict, *args, storage_reader=None, **kwargs):
        if not isinstance(storage_reader, dcp.HuggingFaceStorageReader):
            return load(state_dict, *args, storage_reader=storage_reader, **kwargs)

    dcp.load = load_unless_published

    # The model to "the GPU": here the CPU it is on already (swapping a fake tied weight would fail).
    to = torch.nn.Module.to

    def to_device(self, *args, **kwargs):
        if "fake" in built and len(args) == 1 and not kwargs and isinstance(args[0], (str, torch.device)):
            return self
        return to(self, *args, **kwargs)

    torch.nn.Module.to = to_device

    # DDP's reducer (C++) reads its parameters' data: a stand-in with its interface, for the layout has
    # nothing to check (every rank holds the whole model).
    import contextlib

    from torch.nn import parallel

    class LocalDDP(torch.nn.Module):
        def __init__(self, module, **kwargs):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        @contextlib.contextmanager
        def no_sync(self):
            yield

    parallel.DistributedDataParallel = LocalDDP

    # A device mesh finds this rank's coordinates with small tensors of ranks: real ones.
    from torch.distributed.device_mesh import DeviceMesh

    mesh_init = DeviceMesh.__init__

    def real_mesh_init(self, *args, **kwargs):
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    DeviceMesh.__init__ = real_mesh_init

    # init_device_mesh lays the ranks out with torch.arange: a mesh made after the first model (chapter
    # 10's experts' mesh, once the model says it has experts) is laid out in real numbers too.
    from torch.distributed import device_mesh

    init_device_mesh = device_mesh.init_device_mesh

    def real_init_device_mesh(*args, **kwargs):
        with unset_fake_temporarily():
            return init_device_mesh(*args, **kwargs)

    device_mesh.init_device_mesh = real_init_device_mesh

    # DTensor computes where a rank's shard starts with small index tensors: real numbers too.
    from torch.distributed.tensor import _utils as dtensor_utils

    offsets = dtensor_utils._compute_local_shape_and_global_offset

    def real_offsets(*args, **kwargs):
        with unset_fake_temporarily():
            return offsets(*args, **kwargs)

    dtensor_utils._compute_local_shape_and_global_offset = real_offsets

    # A pipeline's ranks first vote, by sends and receives, on whether every stage knows its neighbours' shapes:
    # the fake group's receives hold zeros, not the peers' votes. This rank takes the chapter's given shapes.
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode

    def shapes_given(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedules._PipelineSchedule._warmup_p2p = shapes_given

    # Chapter 09's dispatch reads its all-to-all's split sizes on the host, which fake tensors do not have:
    # even, as the planner assumes and tools.memory measures.
    from tools.memory import even_splits

    even_splits()

    # PROBE_DRY_RUN_DATA_REPEAT: every packed split repeated that many times, for a dataset as large as the
    # one the command names (the embedded one stands in for it, and is smaller than a cluster's global batch).
    repeat = int(os.environ.get("PROBE_DRY_RUN_DATA_REPEAT", "1"))
    if repeat > 1:
        import datasets

        import common.data

        pack = common.data._pack

        def repeated(*args, **kwargs):
            rows = pack(*args, **kwargs)
            return datasets.concatenate_datasets([rows.with_format(None)] * repeat).with_transform(common.data._rows)

        common.data._pack = repeated

    # The data is real numbers: the samplers' permutations, the DataLoader's seed, the rows it reads.
    for iterable in (RandomSampler, DistributedSampler, DataLoader):
        iterate = iterable.__iter__

        def real_iter(self, iterate=iterate):
            with unset_fake_temporarily():
                items = iterate(self)
            while True:
                with unset_fake_temporarily():
                    item = next(items, StopIteration)
                if item is StopIteration:
                    return
                yield item

        iterable.__iter__ = real_iter

    def after_first_step(optimizer, args, kwargs):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        report = {
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "parameters": built.get("parameters"),
            "local_parameters": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params),
            "gradients": sum(p.grad is not None for p in params),
            "tensors": len(params),
        }
        with open(path, "w") as f:
            json.dump(report, f)
        os._exit(0)  # the step is what was asked: nothing after it (logs, checkpoints) is written

    register_optimizer_step_post_hook(after_first_step)


def fewer_blocks(blocks: int) -> None:
    """PROBE_DRY_RUN_BLOCKS: every model config loaded has at most `blocks` blocks, at its real widths (the
    blocks' code and layout are the same: the others cost only time); for dry runs and tools.memory."""
    from transformers import AutoConfig

    from_pretrained = AutoConfig.from_pretrained.__func__

    def with_fewer_blocks(cls, *args, **kwargs):
        config = from_pretrained(cls, *args, **kwargs)
        if getattr(config, "num_hidden_layers", 0) > blocks:
            config.num_hidden_layers = blocks
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[:blocks]
        return config

    AutoConfig.from_pretrained = classmethod(with_fewer_blocks)

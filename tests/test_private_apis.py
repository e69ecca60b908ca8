"""The private APIs of torch, transformers, torchao and Python that the chapters, common/ and tools/
lean on (DIAGNOSING.md, "Private APIs the chapters lean on"): each still there, so that an upgrade
that moves one fails here, on a CPU, in seconds, saying what to do, and not in a 64-GPU job; and
none used unlisted, so that a new one fails until the table names it.

Imports and attribute checks only: one tiny model built on the meta device, no training."""

import ast
import atexit
import functools
import importlib
import importlib.metadata
import inspect
import logging
import platform
import re
import sys
import traceback
from pathlib import Path

import pytest
import torch
import transformers

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Private APIs the chapters lean on"
SCANNED = ["[0-9][0-9]-*/*.py", "common/*.py", "tools/*.py"]


def table() -> dict[str, list[str]]:
    """DIAGNOSING.md's table: each row's symbol (backticks dropped) and its four cells."""
    text = (REPO / "DIAGNOSING.md").read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]  # below the header
    rows = [[cell.strip() for cell in line.strip(" |").split("|")] for line in lines]
    return {row[0].replace("`", ""): row for row in rows}


def source(module) -> str:
    return Path(inspect.getsourcefile(module)).read_text()


@functools.cache
def tiny_moe():
    """The embedded Qwen3-MoE on the meta device: transformers' attributes as chapters see them."""
    config = transformers.AutoConfig.from_pretrained(REPO / "common" / "tiny_moe")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def consolidate():
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidation

    merge = consolidation.consolidate_safetensors_files_on_every_rank
    names = list(inspect.signature(merge).parameters)[:3]  # as published.exporting passes them
    return names == ["input_dir", "output_dir", "fqn_to_index_mapping"]


def chunk_list():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.tensor import DTensor

    offsets = "offsets" in ChunkStorageMetadata.__dataclass_fields__
    return offsets and callable(DTensor.__create_chunk_list__)


def hf_initialized():
    # What initialize_weights() skips: modules (modeling_utils), tensors (initialization) flagged.
    from transformers import initialization, modeling_utils

    skipped = '"_is_hf_initialized", False)'
    return all(skipped in source(module) for module in [initialization, modeling_utils])


def conversion_ops():
    # The ops by which transformers stacks a mixture of experts' published weights as it loads them.
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist

    conversions = get_checkpoint_conversion_mapping("qwen3_moe")
    ops = {type(op) for conversion in conversions for op in getattr(conversion, "operations", [])}
    return ops == {MergeModulelist, Concatenate}


def dcp_texts():
    """The lines published.loading_pretrained and common.checkpoints look for in DCP's errors (and
    load_state_dict's, chapters 01-03), each rank's in one CheckpointException, as DCP has them."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata

    size = torch.Size([2])
    chunks = [ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)]
    properties = TensorProperties(dtype=torch.float32)
    saved = Metadata({"w": TensorStorageMetadata(properties, size, chunks)})
    errors = [PermissionError(13, "Permission denied")]
    for state in ({"w": torch.zeros(3)}, {"v": torch.zeros(2)}):  # another shape; a tensor unsaved
        try:
            create_default_local_load_plan(state, saved, strict=True)
        except Exception as err:
            errors.append(err)
    failures = {rank: (e, traceback.extract_tb(e.__traceback__)) for rank, e in enumerate(errors)}
    text = str(CheckpointException("load", failures))
    lines = [line.strip() for line in text.splitlines()]
    try:
        torch.nn.Linear(2, 2).load_state_dict({"weight": torch.zeros(3, 2), "bias": torch.zeros(2)})
    except RuntimeError as err:
        text += str(err)
    return (
        any(line.startswith("RuntimeError: Missing key") for line in lines)
        and any(line.startswith("ValueError: Size mismatch") for line in lines)
        and "PermissionError" in text
        and text.lower().count("size mismatch") == 2
    )


def ring_attention():
    from torch.distributed.tensor.experimental._context_parallel import _attention

    forward = inspect.signature(_attention._templated_ring_attention).parameters
    backward = inspect.signature(_attention._templated_ring_attention_backward).parameters
    return (
        isinstance(_attention.custom_ops, dict)
        and {"group", "seq_dim", "op", "query", "key", "value"} <= set(forward)
        and {"grad_out", "grad_out_name", "out", "logsumexp"} <= set(backward)
    )


def op_schema():
    return [a.name for a in torch.ops.aten.mm.default._schema.arguments] == ["self", "mat2"]


def sdpa_kernels():
    # cpu_ring_attention passes the CPU kernels' arguments to the ring by their schemas' names.
    aten = torch.ops.aten
    names = ["_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"]
    names += ["_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"]
    names += ["_scaled_dot_product_flash_attention_for_cpu_backward"]
    if not all(hasattr(aten, name) for name in names):
        return False
    forward = aten._scaled_dot_product_flash_attention_for_cpu.default._schema.arguments
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default._schema.arguments
    names = [a.name for a in forward[:3]] + [backward[0].name]
    # tools.memory.gpu_attention passes the memory-efficient kernel's arguments by position, scale by name.
    efficient = [a.name for a in aten._scaled_dot_product_efficient_attention.default._schema.arguments]
    by_position = ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"]
    return names == ["query", "key", "value", "grad_out"] and efficient == by_position


def reduce_scatter():
    return hasattr(torch.ops._c10d_functional, "reduce_scatter_tensor")


def precision_casts():
    return hasattr(importlib.import_module("torch._inductor.config"), "emulate_precision_casts")


def auto_filter():
    import torchao.float8

    exported = "_auto_filter_for_recipe" in torchao.float8.__all__
    return exported and callable(torchao.float8._auto_filter_for_recipe)


def float8_weight(precomputed_scale=None):
    from torchao.float8.float8_training_tensor import LinearMMConfig
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    fp32, config = torch.ones(2, 2), LinearMMConfig()
    return WeightWithDynamicFloat8CastTensor(fp32, config, torch.float8_e4m3fn, precomputed_scale)


def inner_tensor():
    return type(float8_weight()._tensor) is torch.Tensor


def precomputed_scale():
    weight = float8_weight(torch.ones(()))
    flattened = "_precomputed_scale" in weight.__tensor_flatten__()[0]
    return flattened and weight._precomputed_scale is not None


def extra_state():
    class Stateful(torch.nn.Module):
        def get_extra_state(self):
            return {}

        def set_extra_state(self, state):
            pass

    return list(Stateful().state_dict()) == ["_extra_state"]


def parallel_style():
    from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

    called = "._apply(" in inspect.getsource(parallelize_module)
    return called and "_apply" in ParallelStyle.__abstractmethods__


def all_to_all():
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    names = list(inspect.signature(all_to_all_single_autograd).parameters)[:4]  # as dispatch passes
    return names == ["self", "output_split_sizes", "input_split_sizes", "group"]


def module_parameters():
    # What local_experts relies on: a tensor put in _parameters is what the module's forward reads.
    linear, local = torch.nn.Linear(2, 2), torch.zeros(2, 2)
    linear._parameters.update({"weight": local})
    return linear.weight is local


def experts_implementation():
    from transformers.integrations import moe

    implementation = tiny_moe().config._experts_implementation
    return isinstance(implementation, str) and "grouped_mm" in moe.ALL_EXPERTS_FUNCTIONS.keys()


def recorded_outputs():
    recorded = [getattr(m, "_can_record_outputs", None) or {} for m in tiny_moe().modules()]
    return any("router_logits" in outputs for outputs in recorded)


def no_split_modules():
    classes = {type(m).__name__ for m in tiny_moe().modules()}
    return bool(classes & set(tiny_moe()._no_split_modules or []))


def attn_implementation():
    return isinstance(tiny_moe().config._attn_implementation, str)


def logger_of(name: str) -> bool:
    """Whether the module still logs under its own name, the name the chapters quiet."""
    module = importlib.import_module(name)
    return any(isinstance(v, logging.Logger) and v.name == name for v in vars(module).values())


def fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    return callable(FakeTensor.tolist) and callable(FakeTensorMode)


def mem_tracker():
    from torch.distributed._tools import fsdp2_mem_tracker, mem_tracker

    kinds = ["Sharded Param", "Sharded Grad", "Unsharded Grad", "OptState", "Unsharded Param"]
    kinds += ["Activation", "Temp", "Inputs", "Buffer", "Total"]  # what tools.memory reads
    names = source(fsdp2_mem_tracker) + source(mem_tracker)
    tracker = fsdp2_mem_tracker.FSDPMemTracker
    methods = callable(tracker.reset_mod_stats) and callable(tracker.get_tracker_snapshot)
    return methods and all(f'"{kind}"' in names for kind in kinds)


def pipeline_vote():
    from torch.distributed.pipelining import _utils, schedules, stage

    vote = "_inference_mode" in source(stage) and callable(schedules._PipelineSchedule._warmup_p2p)
    return vote and _utils.InferenceMode.STATIC is not None


def sharding_prop():
    from torch.distributed.tensor import _sharding_prop

    called = "detect_fake_mode()" in source(_sharding_prop)
    return called and callable(_sharding_prop.detect_fake_mode)


def masking():
    from transformers import masking_utils
    from transformers.utils import import_utils

    called = "find_packed_sequence_indices(position_ids)" in source(masking_utils)
    patched = [masking_utils.is_tracing, masking_utils.find_packed_sequence_indices]
    return called and all(callable(f) for f in patched + [import_utils.is_tracing])


# Each row of the table: its library and the versions it was checked on, and its check.
TORCH = ("torch", "2.11-2.14")
TRANSFORMERS = ("transformers", "5.0-5.24")
TORCHAO = ("torchao", "0.18")
PYTHON = ("Python", "3.10-3.13")
CHECKS = {
    "torch.distributed.checkpoint._consolidate_hf_safetensors."
    "consolidate_safetensors_files_on_every_rank": (TORCH, consolidate),
    "DTensor.__create_chunk_list__": (TORCH, chunk_list),
    "_is_hf_initialized": (TRANSFORMERS, hf_initialized),
    "transformers.core_model_loading.MergeModulelist, Concatenate": (TRANSFORMERS, conversion_ops),
    "DCP's error texts: Missing key, Size mismatch, PermissionError": (TORCH, dcp_texts),
    "atexit._run_exitfuncs": (PYTHON, lambda: callable(atexit._run_exitfuncs)),
    "torch.distributed.tensor.experimental._context_parallel._attention: custom_ops, "
    "_templated_ring_attention, _templated_ring_attention_backward": (TORCH, ring_attention),
    "OpOverload._schema": (TORCH, op_schema),
    "torch.ops.aten._scaled_dot_product_flash_attention, _scaled_dot_product_efficient_attention, "
    "_scaled_dot_product_cudnn_attention, _scaled_dot_product_flash_attention_for_cpu, "
    "_scaled_dot_product_flash_attention_for_cpu_backward": (TORCH, sdpa_kernels),
    "torch.ops._c10d_functional.reduce_scatter_tensor": (TORCH, reduce_scatter),
    "torch._inductor.config.emulate_precision_casts": (TORCH, precision_casts),
    "torchao.float8._auto_filter_for_recipe": (TORCHAO, auto_filter),
    "WeightWithDynamicFloat8CastTensor._tensor": (TORCHAO, inner_tensor),
    "WeightWithDynamicFloat8CastTensor._precomputed_scale": (TORCHAO, precomputed_scale),
    '"_extra_state"': (TORCH, extra_state),
    "ParallelStyle._apply": (TORCH, parallel_style),
    "torch.distributed._functional_collectives.all_to_all_single_autograd": (TORCH, all_to_all),
    "Module._parameters": (TORCH, module_parameters),
    "PreTrainedConfig._experts_implementation": (TRANSFORMERS, experts_implementation),
    "PreTrainedModel._can_record_outputs": (TRANSFORMERS, recorded_outputs),
    "PreTrainedModel._no_split_modules": (TRANSFORMERS, no_split_modules),
    "PreTrainedConfig._attn_implementation": (TRANSFORMERS, attn_implementation),
    "torch.distributed.tensor._redistribute's logger": (
        TORCH,
        lambda: logger_of("torch.distributed.tensor._redistribute"),
    ),
    "torch.utils._pytree's logger": (TORCH, lambda: logger_of("torch.utils._pytree")),
    "torch._subclasses.fake_tensor.FakeTensorMode, FakeTensor": (TORCH, fake_tensors),
    "torch.distributed._tools.fsdp2_mem_tracker.FSDPMemTracker": (TORCH, mem_tracker),
    "torch.distributed.pipelining.schedules._PipelineSchedule._warmup_p2p, "
    "torch.distributed.pipelining._utils.InferenceMode, PipelineStage._inference_mode": (
        ("torch", "2.13"),
        pipeline_vote,
    ),
    "torch.distributed.tensor._sharding_prop.detect_fake_mode": (TORCH, sharding_prop),
    "transformers.masking_utils.is_tracing, find_packed_sequence_indices": (TRANSFORMERS, masking),
}


def installed(library: str) -> str:
    return platform.python_version() if library == "Python" else importlib.metadata.version(library)


def test_the_table_and_the_checks_name_the_same_symbols():
    rows, checks = set(table()), set(CHECKS)
    assert rows == checks, f"only in the table: {rows - checks}; only here: {checks - rows}"


@pytest.mark.parametrize("symbol", CHECKS, ids=[re.sub(r"\W+", "-", s)[:60] for s in CHECKS])
def test_each_private_api_is_still_there(symbol):
    (library, checked), still_there = CHECKS[symbol]
    try:
        found, error = still_there(), ""
    except (ImportError, AttributeError, TypeError) as err:  # gone, or called differently
        found, error = False, f" [{type(err).__name__}: {err}]"
    moves = table()[symbol][3]  # the row's "what if it moves", as the comment where it is used says
    version = installed(library)
    assert found, f"{symbol} is gone in {library} {version} (checked on {checked}): {moves}{error}"


# Python's own dunders are public: an attribute by one of these names is no private API.
PYTHON_DUNDERS = {n for t in (object, type, type(len), type(sys), int, list, dict) for n in dir(t)}
PYTHON_DUNDERS = {name for name in PYTHON_DUNDERS if name.startswith("__")}
PYTHON_DUNDERS |= {"__name__", "__module__", "__version__", "__file__", "__wrapped__", "__all__"}
PUBLIC = {"os._exit"}  # documented despite the underscore
PRIVATE = re.compile(r"_[A-Za-z]\w*")
IN_A_PATH = re.compile(r"\w\.(_[A-Za-z]\w*)")  # a module named in a string: "torch.utils._pytree"


def private_uses(tree: ast.Module):
    """(line, name, how) for each private name the code uses: an attribute (not self's), a module
    or name imported, a string naming one (getattr's, a logger's), a private method overridden."""
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    in_fstrings = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            of_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if node.attr not in PYTHON_DUNDERS and ast.unparse(node) not in PUBLIC and not of_self:
                yield node.lineno, node.attr, ast.unparse(node)
        elif isinstance(node, ast.Import):
            for name in [part for alias in node.names for part in alias.name.split(".")]:
                if PRIVATE.fullmatch(name):
                    yield node.lineno, name, "import"
        elif isinstance(node, ast.ImportFrom):
            for name in (node.module or "").split(".") + [alias.name for alias in node.names]:
                if PRIVATE.fullmatch(name) and name != "__future__":
                    yield node.lineno, name, "import"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings or id(node) in in_fstrings:
                continue
            names = [node.value] if PRIVATE.fullmatch(node.value) else IN_A_PATH.findall(node.value)
            for name in names:
                yield node.lineno, name, repr(node.value)
        elif isinstance(node, ast.ClassDef) and node.bases:
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and PRIVATE.fullmatch(method.name):
                    if not method.name.endswith("__"):
                        base = ast.unparse(node.bases[0])
                        yield method.lineno, method.name, f"override of {base}'s"


def own_names(trees) -> set[str]:
    """What the repository defines itself: functions, classes, variables, self's attributes."""
    names = set()
    for node in (node for tree in trees for node in ast.walk(tree)):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names |= {node.attr} if ast.unparse(node.value) == "self" else set()
    return names


def test_every_private_name_the_code_uses_is_in_the_table_and_every_one_listed_is_used():
    files = sorted(path for pattern in SCANNED for path in REPO.glob(pattern))
    trees = {path: ast.parse(path.read_text()) for path in files}
    own = own_names(trees.values())
    uses = [
        (f"{path.relative_to(REPO)}:{line}", name, how)
        for path, tree in trees.items()
        for line, name, how in private_uses(tree)
        if name not in own or how.startswith("override")
    ]
    listed = {word for symbol in table() for word in re.findall(r"\w+", symbol) if word[0] == "_"}
    unlisted = [f"{where}: {name} ({how})" for where, name, how in uses if name not in listed]
    assert not unlisted, (
        f"private names of other libraries that DIAGNOSING.md does not list ({SECTION}): use a "
        "public API, or add a row, its check here, and the row's comment where it is used:\n"
        + "\n".join(unlisted)
    )
    unused = listed - {name for _, name, _ in uses}
    assert not unused, f"DIAGNOSING.md's table lists private names no code uses: {sorted(unused)}"

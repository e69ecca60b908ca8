"""Published weights in and out, each rank its own slices (chapter 04, where no rank holds the whole
model any more; chapters 05-09 carry this file unchanged): where a model's safetensors are, the
names and dtypes transformers publishes, the buffers no file holds, and an export folder that every
rank writes and that appears whole or not at all."""

import copy
import glob
import json
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import snapshot_download
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader
from torch.distributed.checkpoint import QuantizedHuggingFaceStorageReader
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,  # the one merge torch has: private in 2.11-2.13
)
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from common.checkpoints import disk_full, publish
from common.logs import first_line

# What a start reads of a Hub model: the weights as safetensors, the configs, the tokenizer's files.
PUBLISHED_FILES = ["*.safetensors", "*.json", "*.model", "*.txt", "*.tiktoken"]
EXPORT_FILE_BYTES = 5 * 2**30  # a file per 5 GB, as the Hub's large models are published


def pretrained_weights(model_name: str, config) -> Path:
    """The folder of --model-name's safetensors: the local folder, or the Hub model's files
    downloaded once into the cache (HF_HOME), as its config and tokenizer were."""
    _conversions(config.model_type)  # names the chapters can read, or one line now
    folder = os.path.expanduser(model_name)
    if not os.path.isdir(folder):
        try:
            folder = snapshot_download(model_name, allow_patterns=PUBLISHED_FILES)
        except Exception as err:  # offline and not cached, gated, a network error
            message = f"error: --from-pretrained {model_name!r}: {first_line(err)}"
            raise SystemExit(message) from None
    if not glob.glob(os.path.join(folder, "*.safetensors")):
        raise SystemExit(
            f"error: --from-pretrained {model_name!r} has no .safetensors files (published as "
            ".bin only?): each rank reads its slices of safetensors; load it once with "
            "from_pretrained, save_pretrained it to a folder, and pass that folder"
        )
    return Path(folder)


def published_state(model: torch.nn.Module, state: dict, dtype=None) -> dict:
    """`state` (this rank's shards) under the names transformers publishes: a tied weight once, by
    its first name; a mixture of experts' stacked weights one tensor per expert, as published
    checkpoints hold them: views of this rank's whole experts (sharded on dim 0: FSDP's, EP's).
    With `dtype`, each in the dtype transformers holds it in a model of `dtype` (DeepSeek-V3's
    routers and routing biases stay fp32)."""
    named = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - named
    stacked, renames = _conversions(model.config.model_type)
    published = {}  # published name: (the name in memory, the tensor)
    for name, value in state.items():
        target, sources = next(((t, s) for t, s in stacked if name.endswith(t)), (None, None))
        if name in tied or target is None:
            published[name] = None if name in tied else (name, value)
            continue
        local = value.to_local() if isinstance(value, DTensor) else value
        first = value.__create_chunk_list__()[0].offsets[0] if isinstance(value, DTensor) else 0
        for expert, weights in enumerate(local, start=first):  # (2I, H): gate's rows, then up's
            for source, part in zip(sources, weights.chunk(len(sources))):
                expert_name = name.removesuffix(target) + source.replace("*", str(expert))
                published[expert_name] = (name, part)
    for published_name, in_memory in renames:
        published = {name.replace(in_memory, published_name): v for name, v in published.items()}
    published = {name: entry for name, entry in published.items() if entry is not None}
    if dtype is None:  # views: what a start reads into
        return {name: value for name, (_, value) in published.items()}
    with torch.device("meta"):  # a model as transformers builds it in `dtype`: no memory
        built = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), dtype=dtype)
    dtypes = {name: value.dtype for name, value in built.state_dict().items()}
    return {name: value.to(dtypes.get(held, dtype)) for name, (held, value) in published.items()}


def _conversions(model_type: str) -> tuple[list, list]:
    """How transformers converts this family's published weights as it loads them: the stacked
    experts' sources (`mlp.experts.*.gate_proj.weight`, ...) and the plain renamings, last first."""
    stacked, renames = [], []
    for conversion in get_checkpoint_conversion_mapping(model_type) or []:
        ops = [type(op).__name__ for op in getattr(conversion, "operations", [])]
        sources, (target,) = conversion.source_patterns, conversion.target_patterns
        if not ops and not re.search(r"[][()*+?^$|]", sources[0].replace("\\.", "")):
            renames.insert(0, (sources[0].replace("\\", ""), target))
        elif ops in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            stacked.append((target.lstrip("."), [source.lstrip(".") for source in sources]))
        else:
            raise SystemExit(
                f"error: --model-name: transformers converts {model_type}'s published weights in "
                f"a way the chapters cannot name ({ops or sources}): start it from chapter 03"
            )
    return stacked, renames


def weights_reader(folder: Path) -> HuggingFaceStorageReader:
    """DCP's reader of the folder's safetensors, each rank its own slices; block-FP8 weights
    (DeepSeek-V3's, with their `weight_scale_inv`) dequantized as they are read."""
    quantization = json.loads((folder / "config.json").read_text()).get("quantization_config")
    if not quantization:
        return HuggingFaceStorageReader(str(folder))
    blocks = quantization.get("weight_block_size") or [0]
    if quantization.get("quant_method") != "fp8" or len(set(blocks)) != 1:
        raise SystemExit(
            f"error: --from-pretrained: {folder} holds {quantization.get('quant_method')} "
            "quantized weights; the chapters read bf16, fp32 or square-block FP8 (DeepSeek-V3's): "
            "pass a model published in one of those"
        )
    return QuantizedHuggingFaceStorageReader(str(folder), block_size=blocks[0])  # into fp32


def build_buffers(model: torch.nn.Module) -> None:
    """The buffers no checkpoint holds (rotary frequencies, an embedding's scale), which to_empty()
    left unset, computed on each rank by transformers' own initialization of their modules alone."""
    saved = set(model.state_dict())
    unsaved = {name: b for name, b in model.named_buffers() if name not in saved}
    owners = {model.get_submodule(name.rpartition(".")[0]) for name in unsaved}
    for module in model.modules():  # transformers skips what it marks initialized
        module._is_hf_initialized = module not in owners
    for param in model.parameters():
        param._is_hf_initialized = True
    for buffer in unsaved.values():
        buffer.fill_(float("nan") if buffer.is_floating_point() else 0)
    model.initialize_weights()
    for name, buffer in unsaved.items():
        local = buffer.to_local() if isinstance(buffer, DTensor) else buffer
        if local.is_floating_point() and not local.isfinite().all():
            raise SystemExit(
                f"error: --from-pretrained: transformers does not compute {name} of this model "
                "on its own; start it without --from-pretrained, or from chapter 03"
            )


@contextmanager
def loading_pretrained(folder: Path):
    """A folder that lacks a tensor of the model, or holds one of another shape: one line."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        lines = [line.strip() for line in str(err).splitlines()]  # DCP's: each rank's traceback
        known = ("RuntimeError: Missing key", "ValueError: Size mismatch")
        cause = next((line.split(": ", 1)[1] for line in lines if line.startswith(known)), None)
        raise SystemExit(
            f"error: --from-pretrained: {folder} does not hold this model's weights "
            f"({cause or first_line(err)}); pass the folder or Hub name of its own checkpoint"
        ) from None


def check_export_folder(folder: str | None, config) -> None:
    """Before training: --export-hf (if given) must be a new folder (or an earlier export, which it
    replaces) that every rank sees, as each writes its part there and each merges some of the
    files; and the family's published names must be known (_conversions)."""
    if folder is None:
        return
    _conversions(config.model_type)
    path = Path(folder).absolute()
    if path.is_dir() and any(path.iterdir()) and not (path / "config.json").exists():
        raise SystemExit(f"error: --export-hf {folder}: holds other files; pass a new folder")
    existing = next(p for p in [path.parent, *path.parents] if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SystemExit(f"error: --export-hf {folder}: {existing} is not writable")
    token = [secrets.token_hex(4)]  # rank 0's: a file it writes, which every rank then looks for
    dist.broadcast_object_list(token, src=0)
    marker = existing / f".export-check-{token[0]}"
    if dist.get_rank() == 0:
        marker.touch()
    dist.barrier()
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, marker.exists())
    dist.barrier()
    if dist.get_rank() == 0:
        marker.unlink()
    if not all(seen):
        raise SystemExit(
            f"error: --export-hf {folder}: rank {seen.index(False)} does not see rank 0's files "
            "there: pass a folder shared by all nodes, as --save-dir is"
        )


@contextmanager
def exporting(folder: str, files: dict[str, int]):
    """The folder an export is written in, `folder`.tmp: each rank writes its shards in its
    "shards" folder; then every rank merges some of the published files from them (torch's
    consolidation: file i on rank i), and rank 0 renames the folder `folder` (an earlier export
    replaced). A rank killed meanwhile leaves a .tmp folder, never one that looks complete."""
    final = Path(folder).absolute()
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    try:
        yield tmp
        consolidate_safetensors_files_on_every_rank(str(tmp / "shards"), str(tmp), files)
    except (OSError, RuntimeError, CheckpointException) as err:
        if not disk_full(err, tmp.parent):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"error: no space left on the device of {tmp.parent} while exporting --export-hf "
            f"{folder}; nothing was published and the checkpoints are intact: free some space, "
            "then rerun the same command to export again"
        ) from None
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(tmp / "shards")
        if final.exists():  # an earlier export, moved aside, removed once this one is in place
            os.replace(final, final.with_name(final.name + ".old"))
        publish(tmp, final)
        shutil.rmtree(final.with_name(final.name + ".old"), ignore_errors=True)
    dist.barrier()


def published_config(config, dtype: torch.dtype):
    """The config an export publishes: its weights' dtype, the class from_pretrained builds, and
    no quantization (a block-FP8 start was dequantized as it was read)."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def file_index(state: dict) -> dict[str, int]:
    """Each tensor's file (1, 2, ...), the same on every rank: whole tensors in order, a new file
    past EXPORT_FILE_BYTES. Every rank's names: a rank may hold tensors others do not (a stage)."""
    sizes = {name: value.numel() * value.element_size() for name, value in state.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sizes)
    index, file, used = {}, 1, 0
    for name, size in (item for sizes in every for item in sizes.items()):
        if name not in index:
            file, used = (file + 1, 0) if used and used + size > EXPORT_FILE_BYTES else (file, used)
            index[name], used = file, used + size
    return index

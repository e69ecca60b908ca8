"""Published weights in and out, each rank its own slices, for the chapters where no rank holds the
whole model (from FSDP on, every chapter imports this one file): where a model's safetensors are,
the names and dtypes transformers publishes, the buffers no file holds, and an export folder that
every rank writes and that appears whole or not at all."""

import copy
import ctypes
import errno
import glob
import json
import math
import os
import re
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch.distributed.checkpoint import CheckpointException, HuggingFaceStorageReader
from torch.distributed.checkpoint import QuantizedHuggingFaceStorageReader
# Private, checked on torch 2.11-2.14. If it moves: every sharded chapter fails at import: import it
# from its new module, or export with HuggingFaceStorageWriter(enable_consolidation=True), which
# merges on rank 0 alone.
from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files_on_every_rank,  # the one merge torch spreads over the ranks
)
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from common.checkpoints import disk_full, flush, publish
from common.logs import first_line

# What a start reads of a Hub model: the weights as safetensors, the configs, the tokenizer's files.
PUBLISHED_FILES = ["*.safetensors", "*.json", "*.model", "*.txt", "*.tiktoken"]
# A file per 5 GB, as the Hub's large models are published; EXPORT_FILE_BYTES in the environment
# sets another size (the tests' several files from a tiny model).
EXPORT_FILE_BYTES = int(os.environ.get("EXPORT_FILE_BYTES", str(5 * 2**30)))
# What an export wrote, written last: the files a later export may replace, and nothing else.
MANIFEST = "export_manifest.json"


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
        # DTensor's private __create_chunk_list__, checked on torch 2.11-2.14. If it moves:
        # --from-pretrained and --export-hf of a mixture of experts fail with AttributeError here:
        # take the shard's offset from what DCP's planner then asks a DTensor.
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
        # transformers' conversion ops by class name, checked on transformers 5.0-5.24. If they
        # move: --from-pretrained and --export-hf of a mixture of experts stop in one line
        # ("converts ... in a way the chapters cannot name"): add the new op names here.
        elif ops in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
            stacked.append((target.lstrip("."), [source.lstrip(".") for source in sources]))
        else:
            raise SystemExit(
                f"error: --model-name: transformers converts {model_type}'s published weights in "
                f"a way the chapters cannot name ({ops or sources}): start it where every rank loads "
                "the whole model (transformers' from_pretrained), without sharding"
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
    # transformers' private _is_hf_initialized, checked on transformers 5.0-5.24. If it moves:
    # --from-pretrained initializes every weight before reading it (slow), or leaves a buffer NaN
    # (then one line below): set the flag initialize_weights() then reads.
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
                "on its own; start it without --from-pretrained, or where every rank loads the whole "
                "model (transformers' from_pretrained)"
            )


@contextmanager
def loading_pretrained(folder: Path):
    """A folder that lacks a tensor of the model, or holds one of another shape: one line."""
    try:
        yield
    except (Exception, CheckpointException) as err:
        lines = [line.strip() for line in str(err).splitlines()]  # DCP's: each rank's traceback
        # DCP's error texts, checked on torch 2.11-2.14. If they move: another model's folder shows
        # as the error's first line instead of one naming the tensor: match the new texts.
        known = ("RuntimeError: Missing key", "ValueError: Size mismatch")
        cause = next((line.split(": ", 1)[1] for line in lines if line.startswith(known)), None)
        raise SystemExit(
            f"error: --from-pretrained: {folder} does not hold this model's weights "
            f"({cause or first_line(err)}); pass the folder or Hub name of its own checkpoint"
        ) from None


def agree_on_export_folder(folder: str | None, config, model_name: str) -> None:
    """Every rank calls this, before training (a broadcast, barriers, an all-gather): --export-hf
    (if given) must be a new folder, or an earlier export, which it replaces (its manifest lists
    every file in it), never --model-name's folder, and every rank must see it, as each writes its
    part there and each merges some of the files. The family's published names must be known."""
    if folder is None:
        return
    _conversions(config.model_type)
    path = Path(folder).absolute()
    source = Path(model_name).expanduser()
    if source.is_dir() and path.resolve() == source.resolve():
        raise SystemExit(
            f"error: --export-hf {folder} is the folder --model-name reads, which an export would "
            "replace: pass another folder"
        )
    check_only_exports_in(folder, path)
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
        aside = path.with_name(path.name + ".old")  # a kill between replace_export's two renames
        if aside.exists() and not path.exists():
            os.replace(aside, path)  # the earlier export back in place
    if not all(seen):
        raise SystemExit(
            f"error: --export-hf {folder}: rank {seen.index(False)} does not see rank 0's files "
            "there: pass a folder shared by all nodes, as --save-dir is"
        )


def check_only_exports_in(folder: str, path: Path) -> None:
    """The export's folder and its staging folders (.tmp, .old) hold nothing but what an export of
    these chapters wrote (its manifest's files): another model, or a note beside an export, is
    never replaced."""
    staging, aside = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    for place in [path, staging, aside]:
        manifest = place / MANIFEST
        written = json.loads(manifest.read_text()) if manifest.exists() else {}
        listed = {MANIFEST, *written.get("files", [])}
        if not place.exists() or written.get("staging"):  # a staging folder holds only an export's
            continue
        others = sorted(set(os.listdir(place)) - listed) if place.is_dir() else [place.name]
        if others:
            raise SystemExit(
                f"error: --export-hf {folder}: {place} holds files no export wrote "
                f"({', '.join(others[:3])}): pass a new folder"
            )


@contextmanager
def exporting(folder: str, files: dict[str, int]):
    """Every rank calls this. The folder an export is written in, `folder`.tmp: each rank writes
    its shards in its "shards" folder; then every rank merges some of the published files from
    them (torch's consolidation: file i on rank i), and rank 0 writes the index and the manifest
    and puts the folder in `folder`'s place (replace_export). A rank killed meanwhile leaves a .tmp
    folder, never one that looks complete, and an earlier export in place."""
    final = Path(folder).absolute()
    tmp = final.with_name(final.name + ".tmp")
    check_only_exports_in(folder, final)  # again: files may have appeared there since the start
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / MANIFEST).write_text(json.dumps({"staging": True}))  # all in it is this export's
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
        write_index(tmp)
        written = sorted(name for name in os.listdir(tmp) if name != MANIFEST)
        (tmp / MANIFEST).write_text(json.dumps({"files": written}, indent=2))  # complete
        replace_export(tmp, final)
    dist.barrier()


def write_index(folder: Path) -> None:
    """The merged files' index as save_pretrained writes it: one file is model.safetensors with
    no index; several, an index sorted by name that counts the parameters and bytes."""
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    if len(set(index["weight_map"].values())) == 1:
        os.replace(folder / next(iter(index["weight_map"].values())), folder / "model.safetensors")
        index_file.unlink()
        return
    parameters = 0
    for file in set(index["weight_map"].values()):  # their headers only
        with safe_open(folder / file, framework="pt") as tensors:
            parameters += sum(math.prod(tensors.get_slice(n).get_shape()) for n in tensors.keys())
    index["metadata"] = {"total_parameters": parameters, **index["metadata"]}
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_file.write_text(json.dumps(index, indent=2) + "\n")


def replace_export(tmp: Path, final: Path) -> None:
    """`tmp`, complete, published as `final`. An earlier export there is swapped with it in one
    step (renameat2's exchange), then removed: a kill at any point leaves the old export or the
    new one in place. Where the file system cannot swap (NFS), the old one is moved aside (.old)
    for the instant of two renames; a kill there leaves it aside, which the next run puts back."""
    if not final.exists():
        publish(tmp, final)
        return
    flush(tmp)  # what the swap makes visible is whole on disk
    if not swap_folders(tmp, final):
        aside = final.with_name(final.name + ".old")
        os.replace(final, aside)
        os.replace(tmp, final)
        tmp = aside
    shutil.rmtree(tmp)  # the earlier export, now out of place


def swap_folders(a: Path, b: Path) -> bool:
    """Exchanges two folders' names atomically (Linux's renameat2 RENAME_EXCHANGE: ext4, XFS,
    Btrfs, tmpfs, Lustre); False, and nothing changed, where the file system or the OS cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    at_cwd, rename_exchange = -100, 2  # <fcntl.h>'s AT_FDCWD, <linux/fs.h>'s RENAME_EXCHANGE
    if renameat2 is None:
        return False
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # this file system cannot swap
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def published_config(config, dtype: torch.dtype):
    """The config an export publishes: its weights' dtype, the class from_pretrained builds, and
    no quantization (a block-FP8 start was dequantized as it was read)."""
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def agree_on_file_index(state: dict) -> dict[str, int]:
    """Every rank calls this (an all-gather): each tensor's file (1, 2, ...), the same on every
    rank: whole tensors in order, a new file past EXPORT_FILE_BYTES. Every rank's names: a rank
    may hold tensors others do not (a stage)."""
    sizes = {name: value.numel() * value.element_size() for name, value in state.items()}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sizes)
    index, file, used = {}, 1, 0
    for name, size in (item for sizes in every for item in sizes.items()):
        if name not in index:
            file, used = (file + 1, 0) if used and used + size > EXPORT_FILE_BYTES else (file, used)
            index[name], used = file, used + size
    return index

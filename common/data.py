"""Loading a text dataset, packing it into fixed-length rows, and holding some rows out for validation."""

import itertools
import math
import os
from pathlib import Path

import datasets

# The embedded default: a small generated task dataset (see common/make_tiny_default.py), loaded
# through the same calls as a Hub name.
DEFAULT_DATASET = str(Path(__file__).parent / "tiny_tasks")

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".arrow": "arrow"}


def load_and_pack(dataset_name: str, tokenizer, seq_length: int, val_fraction: float):
    """Tokenizes the `text` column of `dataset_name` and packs it into rows of exactly `seq_length` tokens.

    `dataset_name` is a Hub name (`tatsu-lab/alpaca`), a local folder of json/jsonl/parquet/csv/txt
    files, or one such file: `datasets.load_dataset` takes them all. Each document ends with EOS and
    documents are concatenated, so no token is spent on padding. Results are cached by `datasets`
    (keyed by the data, the tokenizer and `seq_length`), so a second run skips the work.

    Returns (train rows, validation rows). Validation is the dataset's own `validation` (or `test`)
    split when it has one; otherwise the last `val_fraction` of the packed rows, which training then
    never sees (None when `val_fraction` is 0).
    """
    splits = _load(dataset_name)
    packed = {name: _pack(split, name, dataset_name, tokenizer, seq_length) for name, split in splits.items()}
    train = packed["train"]
    val = packed.get("validation", packed.get("test"))
    if val is None and val_fraction > 0 and len(train) > 1:
        held_out = math.ceil(val_fraction * len(train))
        train, val = train.select(range(len(train) - held_out)), train.select(range(len(train) - held_out, len(train)))
    return train, val


def looks_like_path(name: str) -> bool:
    """A name meant as a local path: `./x`, `../x`, `/x`, `~/x`, or `a/b` where `a` exists here (a Hub
    name is `owner/name`). Such a name that does not exist is reported as missing, not looked up on the Hub."""
    first = name.split("/")[0]
    return name.startswith((".", "/", "~")) or os.path.exists(name) or ("/" in name and os.path.exists(first))


def _load(dataset_name: str) -> dict:
    flag = f"--dataset-name {dataset_name!r}"
    path = os.path.expanduser(dataset_name)
    looks_local = looks_like_path(dataset_name)
    if looks_local and not os.path.exists(path):
        raise SystemExit(f"error: {flag}: no such file or folder (from {os.getcwd()})")
    try:
        if os.path.isfile(path):
            builder = _BUILDERS.get(Path(path).suffix)
            if builder is None:
                raise SystemExit(f"error: {flag}: cannot read {Path(path).suffix!r} files (use {', '.join(_BUILDERS)})")
            splits = datasets.load_dataset(builder, data_files=path)
        else:
            splits = datasets.load_dataset(path)
    except SystemExit:
        raise
    except Exception as err:  # datasets raises many types for unreadable files and unreachable names
        where = "its files cannot be read" if looks_local else "not a local path nor a Hub dataset that can be reached"
        raise SystemExit(f"error: {flag}: {where} ({_first_line(err)})") from None
    if "train" not in splits:
        raise SystemExit(f"error: {flag} has no 'train' split (splits: {list(splits)})")
    return {name: split for name, split in splits.items() if name in ("train", "validation", "test")}


def _pack(data, split, dataset_name, tokenizer, seq_length):
    flag = f"--dataset-name {dataset_name!r}"
    if len(data) == 0:
        raise SystemExit(f"error: {flag}: its {split} split is empty")
    if "text" not in data.column_names:
        raise SystemExit(f"error: {flag} has no 'text' column (columns: {data.column_names})")
    if data.features["text"] != datasets.Value("string"):
        raise SystemExit(f"error: {flag}: its 'text' column holds {data.features['text']}, not text")

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # A worker process costs about a second to start: only big datasets are worth several.
    num_proc = max(1, min(cores, len(data) // 50_000)) if cores else 1

    def tokenize(batch, indices):
        for text, index in zip(batch["text"], indices):
            if text is None:
                raise ValueError(f"row {index} of its {split} split has no text (null)")
        ids = tokenizer(batch["text"])["input_ids"]
        return {"input_ids": [doc + [tokenizer.eos_token_id] for doc in ids]}

    def pack(batch):
        stream = list(itertools.chain.from_iterable(batch["input_ids"]))
        # The tail shorter than seq_length (at most one row per 1000 documents) is dropped.
        rows = [stream[i : i + seq_length] for i in range(0, len(stream) - seq_length + 1, seq_length)]
        return {"input_ids": rows, "labels": rows}

    try:
        data = data.map(
            tokenize,
            batched=True,
            with_indices=True,
            remove_columns=data.column_names,
            num_proc=num_proc,
            desc=f"Tokenizing {split}",
        )
    except ValueError as err:
        raise SystemExit(f"error: {flag}: {str(err).splitlines()[0]}") from None
    data = data.map(pack, batched=True, num_proc=num_proc, desc=f"Packing {split} into rows of {seq_length} tokens")
    if len(data) == 0:
        raise SystemExit(f"error: {flag}: its {split} split has fewer than --seq-length {seq_length} tokens")
    return data.with_format("torch")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"

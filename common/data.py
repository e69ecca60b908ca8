"""Loading a text dataset, packing it into fixed-length rows, and holding some rows out for validation."""

import itertools
import math
import os
from pathlib import Path

import datasets
import numpy as np
import torch

# The embedded default: a small generated task dataset (see tools/make_tiny_default.py), loaded
# through the same calls as a Hub name.
DEFAULT_DATASET = str(Path(__file__).parent / "tiny_tasks")

_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".txt": "text", ".arrow": "arrow"}


def load_and_pack(dataset_name: str, tokenizer, seq_length: int, val_fraction: float, min_val_rows: int = 1):
    """(train, validation) rows of exactly `seq_length` tokens from the `text` column of `dataset_name`: a Hub
    name, a local folder of json/jsonl/parquet/csv/txt files, or one such file (`datasets.load_dataset`).

    Documents end with EOS and are concatenated: no padding. `datasets` caches the packed rows (int32, 4 bytes
    per token), keyed by the data, tokenizer and `seq_length`; they are read as int64 `input_ids`, and as
    `labels` (the model shifts them). Validation is the dataset's own `validation` (or `test`) split, else the
    last `val_fraction` of the rows, which training never sees (None when 0), and at least `min_val_rows`
    (one evaluation batch on all ranks: 1% of a small dataset can be fewer rows than a batch).
    """
    splits = _load(dataset_name)
    packed = {name: _pack(split, name, dataset_name, tokenizer, seq_length) for name, split in splits.items()}
    train = packed["train"]
    val_split = "validation" if "validation" in packed else "test"
    val = packed.get(val_split)
    if val is None and val_fraction > 0:
        held_out = max(math.ceil(val_fraction * len(train)), min_val_rows)
        if 2 * min_val_rows > len(train):
            raise SystemExit(
                f"error: --batch-size: the dataset packs into {len(train)} rows of {seq_length} tokens, too few for "
                f"a batch of {min_val_rows} rows (--batch-size on every rank) to train on and another to validate "
                "on; pass a smaller --batch-size or --seq-length"
            )
        if held_out >= len(train):
            raise SystemExit(
                f"error: --val-fraction {val_fraction} holds out all {len(train)} rows of {seq_length} tokens, "
                "leaving none to train on: pass a smaller --val-fraction, or 0 (no validation)"
            )
        train, val = train.select(range(len(train) - held_out)), train.select(range(len(train) - held_out, len(train)))
    if val is not None and len(val) < min_val_rows:
        raise SystemExit(
            f"error: --dataset-name {dataset_name!r}: its {val_split} split packs into {len(val)} rows of "
            f"{seq_length} tokens, fewer than one evaluation batch ({min_val_rows} rows: --batch-size on every "
            "rank); pass a smaller --batch-size or --seq-length"
        )
    return train, val


def looks_like_path(name: str) -> bool:
    """A name meant as a local path (`./x`, `/x`, `~/x`, or `a/b` where `a` exists here; a Hub name is `owner/name`):
    one that does not exist is reported missing, not looked up on the Hub."""
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
        raise SystemExit(f"error: {flag}: {where} ({first_line(err)})") from None
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
    # A worker process costs about a second to start: only big datasets are worth several. Otherwise this
    # process maps (None): datasets runs num_proc=1 in a forked pool of one and a manager process.
    num_proc = min(cores or 1, len(data) // 50_000)

    def tokenize_and_pack(batch, indices):
        for text, index in zip(batch["text"], indices):
            if text is None:
                raise ValueError(f"row {index} of its {split} split has no text (null)")
        docs = tokenizer(batch["text"])["input_ids"]
        # The documents end to end, each followed by EOS, in one int32 array: no Python loop per token.
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        tokens = np.fromiter(itertools.chain.from_iterable(docs), dtype=np.int32, count=int(lengths.sum()))
        stream = np.insert(tokens, np.cumsum(lengths), tokenizer.eos_token_id)
        # The tail shorter than seq_length is dropped: less than one row per batch of documents.
        return {"input_ids": stream[: len(stream) // seq_length * seq_length].reshape(-1, seq_length)}

    try:
        data = data.map(
            tokenize_and_pack,
            batched=True,
            # Documents per batch: 1000, or for long rows enough to make many rows (131,072 tokens: 16,384
            # documents), or a batch of short documents would pack into no row at all, and its tokens be lost.
            batch_size=max(1000, seq_length // 8),
            with_indices=True,
            remove_columns=data.column_names,
            features=datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"), length=seq_length)}),
            num_proc=num_proc if num_proc > 1 else None,
            desc=f"Tokenizing and packing {split} into rows of {seq_length} tokens",
        )
    except ValueError as err:
        raise SystemExit(f"error: {flag}: {str(err).splitlines()[0]}") from None
    if len(data) == 0:
        raise SystemExit(f"error: {flag}: its {split} split has fewer than --seq-length {seq_length} tokens")
    return data.with_transform(_rows)


def _rows(batch: dict) -> dict:
    input_ids = torch.tensor(np.asarray(batch["input_ids"]), dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids}


def first_line(err: BaseException) -> str:
    """An exception as one line of an error message: its type and the first line of its text."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"

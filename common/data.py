"""Loading a text dataset, packing it into fixed-length rows, holding rows out for validation."""

import math
import os
from itertools import chain
from pathlib import Path

import datasets
import numpy as np
import torch

from common.logs import first_line

# The embedded default (tools/make_tiny_default.py): loaded through the same calls as a Hub name.
DEFAULT_DATASET = str(Path(__file__).parent / "tiny_tasks")
# The `datasets` builder that reads each kind of file.
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_BUILDERS |= {".txt": "text", ".arrow": "arrow"}


def load_and_pack(
    dataset_name: str, tokenizer, seq_length: int, val_fraction: float, min_val_rows: int = 1
):
    """(train, validation) rows of `seq_length` tokens from the `text` column of a Hub dataset, a
    local folder of json/jsonl/parquet/csv/txt files, or one such file: documents end with EOS,
    concatenated (no padding), cached by `datasets` as int32. Validation: the `validation` (or
    `test`) split, else the last `val_fraction` of the rows (None when 0), at least `min_val_rows`
    (one evaluation batch on all ranks: 1% of a small dataset can be fewer rows than that)."""
    splits = _load(dataset_name)
    packed = {n: _pack(s, n, dataset_name, tokenizer, seq_length) for n, s in splits.items()}
    train, rows = packed["train"], f"rows of {seq_length} tokens"
    val_split = "validation" if "validation" in packed else "test"
    val = packed.get(val_split)
    if val is None and val_fraction > 0:
        held_out = max(math.ceil(val_fraction * len(train)), min_val_rows)
        if 2 * min_val_rows > len(train):
            raise SystemExit(
                f"error: --batch-size: the dataset packs into {len(train)} {rows}, too few for a "
                f"batch of {min_val_rows} rows (--batch-size on every rank) to train on and another"
                " to validate on; pass a smaller --batch-size or --seq-length"
            )
        if held_out >= len(train):
            raise SystemExit(
                f"error: --val-fraction {val_fraction} holds out all {len(train)} {rows}, leaving "
                "none to train on: pass a smaller --val-fraction, or 0 (no validation)"
            )
        cut = len(train) - held_out
        train, val = train.select(range(cut)), train.select(range(cut, len(train)))
    if val is not None and len(val) < min_val_rows:
        raise SystemExit(
            f"error: --dataset-name {dataset_name!r}: its {val_split} split packs into {len(val)} "
            f"{rows}, fewer than one evaluation batch ({min_val_rows} rows: --batch-size on every "
            "rank); pass a smaller --batch-size or --seq-length"
        )
    return train, val


def looks_like_path(name: str) -> bool:
    """A name meant as a local path (`./x`, `/x`, `~/x`, or `a/b` where `a` exists; a Hub name is
    `owner/name`): one that does not exist is reported missing, not looked up on the Hub."""
    explicit = name.startswith((".", "/", "~")) or os.path.exists(name)
    return explicit or ("/" in name and os.path.exists(name.split("/")[0]))


def _load(dataset_name: str) -> dict:
    flag, path = f"--dataset-name {dataset_name!r}", os.path.expanduser(dataset_name)
    looks_local, suffix = looks_like_path(dataset_name), Path(path).suffix
    if looks_local and not os.path.exists(path):
        raise SystemExit(f"error: {flag}: no such file or folder (from {os.getcwd()})")
    if os.path.isfile(path) and suffix not in _BUILDERS:
        raise SystemExit(
            f"error: {flag}: cannot read {suffix!r} files (use {', '.join(_BUILDERS)})"
        )
    try:
        if os.path.isfile(path):
            splits = datasets.load_dataset(_BUILDERS[suffix], data_files=path)
        else:
            splits = datasets.load_dataset(path)
    except Exception as err:  # datasets raises many types: unreadable files, unreachable names
        where = "not a local path nor a Hub dataset that can be reached"
        if looks_local:
            where = "its files cannot be read"
        raise SystemExit(f"error: {flag}: {where} ({first_line(err)})") from None
    if "train" not in splits:
        raise SystemExit(f"error: {flag} has no 'train' split (splits: {list(splits)})")
    return {name: s for name, s in splits.items() if name in ("train", "validation", "test")}


def _pack(data, split, dataset_name, tokenizer, seq_length):
    flag = f"--dataset-name {dataset_name!r}"
    if len(data) == 0:
        raise SystemExit(f"error: {flag}: its {split} split is empty")
    if "text" not in data.column_names:
        raise SystemExit(f"error: {flag} has no 'text' column (columns: {data.column_names})")
    if data.features["text"] != datasets.Value("string"):
        raise SystemExit(f"error: {flag}: its 'text' column holds {data.features['text']}, not str")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # A worker takes about a second to start: only big datasets get several. Else this process maps
    # (None): num_proc=1 would run a forked pool of one and a manager process.
    num_proc = min(cores or 1, len(data) // 50_000)

    def tokenize_and_pack(batch, indices):
        for text, index in zip(batch["text"], indices):
            if text is None:
                raise ValueError(f"row {index} of its {split} split has no text (null)")
        docs = tokenizer(batch["text"])["input_ids"]
        # The documents end to end, each followed by EOS, in one int32 array: no loop per token.
        lengths = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
        tokens = np.fromiter(chain.from_iterable(docs), dtype=np.int32, count=int(lengths.sum()))
        stream = np.insert(tokens, np.cumsum(lengths), tokenizer.eos_token_id)
        # The tail shorter than seq_length is dropped: less than one row per batch of documents.
        rows = len(stream) // seq_length
        return {"input_ids": stream[: rows * seq_length].reshape(-1, seq_length)}

    row = datasets.Sequence(datasets.Value("int32"), length=seq_length)
    try:
        data = data.map(
            tokenize_and_pack,
            batched=True,
            # Enough documents per batch for many rows (16,384 for rows of 131,072 tokens): a batch
            # that packs into no row would lose its tokens.
            batch_size=max(1000, seq_length // 8),
            with_indices=True,
            remove_columns=data.column_names,
            features=datasets.Features({"input_ids": row}),
            num_proc=num_proc if num_proc > 1 else None,
            desc=f"Tokenizing and packing {split} into rows of {seq_length} tokens",
        )
    except ValueError as err:
        raise SystemExit(f"error: {flag}: {str(err).splitlines()[0]}") from None
    if len(data) == 0:
        raise SystemExit(
            f"error: {flag}: its {split} split has fewer than --seq-length {seq_length} tokens"
        )
    return data.with_transform(_rows)


def _rows(batch: dict) -> dict:
    input_ids = torch.tensor(np.asarray(batch["input_ids"]), dtype=torch.long)
    return {"input_ids": input_ids, "labels": input_ids}  # the model shifts the labels

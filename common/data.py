"""Loading a dataset of text or of conversations, packing it into fixed-length rows (each document
attending to itself only, where asked), holding rows out for validation."""

import math
import os
from itertools import chain
from pathlib import Path

import datasets
import numpy as np
import torch

from common import chat, mixture

from common.logs import first_line

# The embedded default (tools/make_tiny_default.py): loaded through the same calls as a Hub name.
DEFAULT_DATASET = str(Path(__file__).parent / "tiny_tasks")
# The `datasets` builder that reads each kind of file.
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
_BUILDERS |= {".txt": "text", ".arrow": "arrow"}


def load_data(args, tokenizer, val_rows: int = 1):
    """load_and_pack with the chapters' flags: --dataset-name (several: a mixture at
    --dataset-weights), --seq-length, --val-fraction, --train-on, --document-masking; at least
    `val_rows` validation rows (one evaluation batch on all ranks)."""
    return load_and_pack(
        args.dataset_name, tokenizer, args.seq_length, args.val_fraction, val_rows,
        args.train_on, args.document_masking, args.dataset_weights,
    )  # fmt: skip


def load_and_pack(
    dataset_name: str | list[str],
    tokenizer,
    seq_length: int,
    val_fraction: float,
    min_val_rows: int = 1,
    train_on: str = "assistant",
    document_masking: bool | None = None,
    weights: list[float] | None = None,
):
    """(train, validation) rows of `seq_length` tokens from a Hub dataset, a local folder of
    json/jsonl/parquet/csv/txt files, or one such file, cached by `datasets` as int32. A `text`
    column: documents end with EOS, concatenated (no padding). A `messages` column (or `prompt` and
    `completion`): conversations through the tokenizer's chat template, only the assistant's tokens
    trained unless `train_on` is "all" (common/chat.py), whole in a row. With `document_masking`
    (the default for conversations) rows hold position ids restarting at each document, from which
    transformers builds a block-causal mask: a document attends to itself only. Validation: the
    `validation` (or `test`) split, else the last `val_fraction` of the rows (None when 0), at least
    `min_val_rows` (one evaluation batch on all ranks: 1% of a small dataset can be fewer rows).
    Several names, with `weights`: each source packed so, the two a common.mixture.Mixture each
    (its validation a Mixture of the sources' validation rows)."""
    names = [dataset_name] if isinstance(dataset_name, str) else list(dataset_name)
    mixture.check(names, weights)
    loaded = [_load(name) for name in names]  # every source read before any is packed
    kinds = [chat.kind(splits["train"], name) for splits, name in zip(loaded, names)]
    # Rows of a mixture share batches: all hold position ids, or none (text masks if chat does).
    masking = any(k != "text" for k in kinds) if document_masking is None else document_masking
    packing = dict(tokenizer=tokenizer, seq_length=seq_length, val_fraction=val_fraction)
    packing |= dict(min_val_rows=min_val_rows, train_on=train_on, masking=masking)
    packed = [_split(s, name, kind, **packing) for s, name, kind in zip(loaded, names, kinds)]
    if len(names) == 1:
        return packed[0]
    labels = mixture.labels(names)
    train = mixture.Mixture(dict(zip(labels, (t for t, _ in packed))), weights)
    if any(v is None for _, v in packed):  # --val-fraction 0, and a source without a split
        return train, None
    return train, mixture.Mixture(dict(zip(labels, (v for _, v in packed))), weights)


def _split(splits, dataset_name, kind, val_fraction, min_val_rows, train_on, **packing):
    """One source's (train, validation) rows: its splits packed, validation held out if none."""
    seq_length = packing["seq_length"]
    if kind == "text":
        packed = {n: _pack(s, n, dataset_name, **packing) for n, s in splits.items()}
    else:
        packing["train_on"] = train_on
        packed = {
            n: chat.pack(s, n, dataset_name, **packing, num_proc=workers(len(s))).with_transform(_rows)
            for n, s in splits.items()
        }
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


def workers(documents: int) -> int | None:
    """Processes that tokenize `documents`: one per 50,000 up to the cores. A worker takes about a
    second to start: only big datasets get several; else this process maps (None: num_proc=1 would
    run a forked pool of one and a manager process). `datasets` keys its cache by it too."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    num_proc = min(cores or 1, documents // 50_000)
    return num_proc if num_proc > 1 else None


def steps_per_epoch(train_data, global_batch_rows: int, args) -> int:
    """Optimizer steps in an epoch of `train_data`: refused in one line naming the flags where one
    step (`global_batch_rows`, --batch-size x --grad-accum-steps on every dp rank) takes more rows
    than there are."""
    steps = len(train_data) // global_batch_rows
    if steps == 0:
        raise SystemExit(
            f"error: --batch-size {args.batch_size} x --grad-accum-steps {args.grad_accum_steps} "
            f"({global_batch_rows} rows a step) is larger than the dataset ({len(train_data)} "
            f"training rows of {args.seq_length} tokens); pass a smaller --batch-size or "
            "--seq-length"
        )
    return steps


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


def _pack(data, split, dataset_name, tokenizer, seq_length, masking=False):
    flag = f"--dataset-name {dataset_name!r}"
    if len(data) == 0:
        raise SystemExit(f"error: {flag}: its {split} split is empty")
    if "text" not in data.column_names:
        raise SystemExit(
            f"error: {flag} has no 'text' column, nor 'messages' or 'prompt' and 'completion' (columns: "
            f"{data.column_names})"
        )
    if data.features["text"] != datasets.Value("string"):
        raise SystemExit(f"error: {flag}: its 'text' column holds {data.features['text']}, not str")

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
        packed = {"input_ids": stream[: rows * seq_length].reshape(-1, seq_length)}
        if masking:  # each document's positions from 0 (and each row's: a document cut at its start)
            starts = np.cumsum(lengths + 1) - (lengths + 1)
            packed["position_ids"] = document_positions(starts, rows, seq_length)
        return packed

    row = datasets.Sequence(datasets.Value("int32"), length=seq_length)
    features = {"input_ids": row} | ({"position_ids": row} if masking else {})
    try:
        data = data.map(
            tokenize_and_pack,
            batched=True,
            # Enough documents per batch for many rows (16,384 for rows of 131,072 tokens): a batch
            # that packs into no row would lose its tokens.
            batch_size=max(1000, seq_length // 8),
            with_indices=True,
            remove_columns=data.column_names,
            features=datasets.Features(features),
            num_proc=workers(len(data)),
            desc=f"Tokenizing and packing {split} into rows of {seq_length} tokens",
        )
    except ValueError as err:
        raise SystemExit(f"error: {flag}: {str(err).splitlines()[0]}") from None
    if len(data) == 0:
        raise SystemExit(
            f"error: {flag}: its {split} split has fewer than --seq-length {seq_length} tokens"
        )
    return data.with_transform(_rows)


def document_positions(starts, rows: int, seq_length: int) -> np.ndarray:
    """(rows, seq_length) int32 position ids of a stream cut into rows, where documents begin at the
    sorted offsets `starts`: each token's distance from its document's start or its row's start."""
    offsets = np.arange(rows * seq_length)
    begun = np.maximum(starts[np.searchsorted(starts, offsets, side="right") - 1], 0)
    row_start = offsets // seq_length * seq_length
    return (offsets - np.maximum(begun, row_start)).astype(np.int32).reshape(rows, seq_length)


def _rows(batch: dict) -> dict:
    rows = {}
    for name, ids in batch.items():  # made here (a profile names this function: test_common.py)
        rows[name] = torch.tensor(np.asarray(ids), dtype=torch.long)
    input_ids = rows.pop("input_ids")
    # Text trains every token: its labels are its tokens (the model shifts the labels).
    return {"input_ids": input_ids, "labels": rows.pop("labels", input_ids), **rows}

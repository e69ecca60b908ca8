"""Loading a text dataset and packing it into fixed-length training rows."""

import itertools
import os

import datasets


def load_and_pack(dataset_name: str, tokenizer, seq_length: int) -> datasets.Dataset:
    """Tokenizes the `text` column of `dataset_name` and packs it into rows of exactly `seq_length` tokens.

    `dataset_name` is a Hub name (`tatsu-lab/alpaca`) or a local folder of json/jsonl/parquet/txt files:
    `datasets.load_dataset` takes both, so there is one code path. Each document ends with EOS and
    documents are concatenated, so no token is spent on padding. Results are cached by `datasets`
    (keyed by the data, the tokenizer and `seq_length`), so a second run skips the work.
    """
    try:
        data = datasets.load_dataset(dataset_name, split="train")
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(
            f"error: --dataset-name {dataset_name!r} is neither a local dataset folder nor a Hub dataset "
            f"that can be reached ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from err
    if "text" not in data.column_names:
        raise SystemExit(
            f"error: --dataset-name {dataset_name!r} has no 'text' column (columns: {data.column_names})"
        )

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    # A worker process costs about a second to start: only big datasets are worth several.
    num_proc = max(1, min(cores, len(data) // 50_000)) if cores else 1

    def tokenize(batch):
        ids = tokenizer(batch["text"])["input_ids"]
        return {"input_ids": [doc + [tokenizer.eos_token_id] for doc in ids]}

    def pack(batch):
        stream = list(itertools.chain.from_iterable(batch["input_ids"]))
        # The tail shorter than seq_length (at most one row per 1000 documents) is dropped.
        rows = [stream[i : i + seq_length] for i in range(0, len(stream) - seq_length + 1, seq_length)]
        return {"input_ids": rows, "labels": rows}

    data = data.map(tokenize, batched=True, remove_columns=data.column_names, num_proc=num_proc, desc="Tokenizing")
    data = data.map(pack, batched=True, num_proc=num_proc, desc=f"Packing into rows of {seq_length} tokens")
    return data.with_format("torch")

"""How fast conversations are prepared (rendered with the chat template, tokenized, masked, packed:
common.data.load_and_pack) against the tokenizer's own throughput on the same text and cores
(BENCHMARKS.md, "Preparing conversations"). Not a test: a measurement.

    python tests/prepare_speed.py /tmp/chatcorpus

Writes FOLDER/train.jsonl first if it is missing: the tiny conversations (common/tiny_chat) repeated
to 100 MiB or more. The tokenizer alone is timed on the same conversations rendered beforehand (the
rendering not timed), in batches of 1,000 as the text path tokenizes (the fast tokenizer's threads).
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_corpus(path: Path) -> None:
    import pyarrow.parquet as pq

    lines = [json.dumps(row) + "\n" for row in pq.read_table(REPO / "common/tiny_chat/train.parquet").to_pylist()]
    times = -(-100 * 2**20 // sum(map(len, lines)))
    with open(path, "w") as f:
        for _ in range(times):
            f.writelines(lines)


def main() -> None:
    folder = Path(sys.argv[1])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    if not path.exists():
        write_corpus(path)
    os.environ["HF_HOME"] = tempfile.mkdtemp()  # an empty cache: prepared, not found
    sys.path.insert(0, str(REPO))
    import datasets
    from transformers import AutoTokenizer

    from common import DEFAULT_MODEL, load_and_pack

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    data = datasets.load_dataset("json", data_files=str(path))["train"]
    print(f"{path.stat().st_size / 2**20:.1f} MiB, {len(data):,} conversations, {len(os.sched_getaffinity(0))} cores")
    texts = tokenizer.apply_chat_template([list(turns) for turns in data["messages"]], tokenize=False)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(texts), 1000):
        tokens += sum(map(len, tokenizer(texts[i : i + 1000], add_special_tokens=False)["input_ids"]))
    alone = time.perf_counter() - start
    print(f"the tokenizer alone: {tokens:,} tokens in {alone:.1f} s, {tokens / alone:,.0f} tokens/s")
    start = time.perf_counter()
    load_and_pack(str(path), tokenizer, 128, 0.0)
    prepared = time.perf_counter() - start
    print(f"load_and_pack: {prepared:.1f} s, {tokens / prepared:,.0f} tokens/s, {alone / prepared:.0%} of the tokenizer's")


if __name__ == "__main__":
    main()

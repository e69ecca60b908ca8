"""What a start from published weights and an export cost each rank (test_published_weights.py and
BENCHMARKS.md). Run under torchrun (gloo, CPU), it starts chapter 04's model from a folder of seeded
weights saved in bf16 in several files (made by rank 0 if missing), through the chapter's own
load_pretrained after its parallelize, then exports it through its export_hf; each rank samples its
anonymous memory (RssAnon: not the files it maps) every millisecond in a thread, and rank 0 prints
a JSON line: per rank, the peak above the value before each call, the seconds, its shard's bytes and
the largest tensor's, whether its weights equal from_pretrained's bitwise; and whether the export's
files hold the source's names, shapes, dtypes and values.

    torchrun --nproc-per-node 4 tests/published_weights.py FOLDER [--family llama|llama-tied]
             [--chapter 04-fsdp|08-pipeline-parallel ...] [--old]

--old measures the chapter as it was before each rank read its own slices (BENCHMARKS.md's "before"):
the git revision's build_model / send_full_weights / export_hf, rank 0 holding the whole model.
"""

import argparse
import gc
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from common import transformer_blocks  # noqa: E402
from tools.memory import load  # noqa: E402  # a chapter's script as a module

OLD_REVISION = "197a48b"  # the last commit before the sliced start and export
# 61M parameters: 244 MB in fp32, its largest tensors (embeddings, output layer) 65 MB each.
SHAPES = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512)  # fmt: skip


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


class Peak:
    """The highest RssAnon while the block runs, above its value at the start."""

    def __enter__(self):
        gc.collect()
        self.base = self.peak = rss_anon()
        self.running, self.start = True, time.perf_counter()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        return self

    def sample(self):
        while self.running:
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak, self.seconds = max(self.peak, rss_anon()) - self.base, time.perf_counter() - self.start


def make_source(folder: Path, tied: bool) -> None:
    """Seeded weights in bf16, in files of at most 50 MB, with the tiny default's tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="50MB")
    AutoTokenizer.from_pretrained(REPO / "common" / "tiny_llama").save_pretrained(folder)


def old_chapter(name: str):
    """The chapter's script at OLD_REVISION, as a module."""
    source = subprocess.run(["git", "show", f"{OLD_REVISION}:{name}/train_llm.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"old_{name.replace('-', '_')}_{dist.get_rank()}.py"
    path.write_text(source)
    sys.path.insert(0, str(REPO / name))
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--family", default="llama", choices=["llama", "llama-tied"])
    parser.add_argument("--old", action="store_true")
    options = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    source = options.folder / options.family
    if rank == 0 and not (source / "config.json").exists():
        make_source(source, tied=options.family == "llama-tied")
    dist.barrier()
    chapter = old_chapter("04-fsdp") if options.old else load("04-fsdp")
    args = chapter.get_parser().parse_args(["--model-name", str(source), "--from-pretrained"])
    config, tokenizer = AutoConfig.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    chapter.parallelize(model, transformer_blocks(model), mesh, args, torch.float32, False)
    model.to_empty(device="cpu")
    with Peak() as start:
        if options.old:
            full_model = chapter.build_model(args, config) if rank == 0 else None
            chapter.send_full_weights(model, full_model, torch.device("cpu"))
            del full_model
        else:
            chapter.load_pretrained(model, source)
    export = options.folder / f"export-{options.family}-{world_size}{'-old' if options.old else ''}"
    with Peak() as exported:
        chapter.export_hf(model, config, tokenizer, str(export), torch.bfloat16)
    dist.barrier()
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    equal = all(torch.equal(p.full_tensor() if isinstance(p, DTensor) else p, reference.get_parameter(name))
                for name, p in model.named_parameters())  # fmt: skip
    mine = {"start_peak": start.peak, "start_s": start.seconds, "export_peak": exported.peak,
            "export_s": exported.seconds, "shard": shard, "largest": largest, "equal": equal}  # fmt: skip
    every = [None] * world_size
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(json.dumps({"ranks": every, "export_equals_source": same_files(source, export)}))
    dist.destroy_process_group()


def same_files(source: Path, export: Path) -> bool:
    """The export's tensors, by name: the source's names, shapes, dtypes and values."""

    def tensors(folder):
        found = {}
        for path in folder.glob("*.safetensors"):
            with safe_open(path, framework="pt") as f:
                found |= {name: f.get_tensor(name) for name in f.keys()}
        return found

    a, b = tensors(source), tensors(export)
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]) for n in a)


if __name__ == "__main__":
    main()

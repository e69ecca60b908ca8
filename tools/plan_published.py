"""Published weights (chapters 04-10): what --from-pretrained reads and --export-hf writes on each
GPU and node, and what they hold meanwhile above the training state."""

from common import published
from tools.plan_model import Layout, shard_ranks

# The largest file --export-hf writes: the chapters' rule (common/published.py, from chapter 04 on).
EXPORT_FILE_BYTES = published.EXPORT_FILE_BYTES


def export_files(m: dict) -> list[int]:
    """The bytes of each file --export-hf publishes: whole tensors in order, a new file once one
    would pass EXPORT_FILE_BYTES (published.agree_on_file_index's rule, chapters 04-10), a mixture
    of experts' one per expert (DeepSeek-V3's stacked gate_up_proj, 15 GiB, in 512 of 29 MiB). In
    the model's order: the chapters list each rank's own tensors first, which may move some experts
    to another file (the same bytes)."""
    files = [0]
    for numel in m["published"]:
        size = numel * m["dtype"].itemsize
        if files[-1] and files[-1] + size > EXPORT_FILE_BYTES:
            files.append(0)
        files[-1] += size
    return files


def published_io(m: dict, layout: Layout, result: dict) -> dict:
    """--from-pretrained and --export-hf (chapters 04-09) on one GPU of `layout` (`result`: its
    plan): the bytes it reads and writes of the published safetensors, and what it holds meanwhile
    above its training state; per node, what its GPUs move together through its storage link."""
    disk = m["dtype"].itemsize
    read = m["read_bytes"] / m["params"]  # per parameter: disk's, or a block-FP8 release's ~1
    # The parameters of this GPU's fp32 shards (of a pipeline's stages, the largest).
    held = max(r["weights"] for r in result.get("stages", [result])) / 4
    dp = layout.gpus // layout.tp // layout.pp  # a stage's ranks that split no tensor: dp x cp
    shard = shard_ranks(layout)
    replicas, split = dp // shard, shard * layout.tp  # split: the GPUs that split each large tensor
    g = min(layout.gpus_per_node, layout.gpus)
    # DCP writes a replicated shard once, from one of its replicas (_dedup_save_plans). Then torch's
    # merge gives file i (from 1) to rank i % world size: it reads the file's pieces, writes it.
    files = export_files(m)
    merged = [0] * layout.gpus
    for i, size in enumerate(files, 1):
        merged[i % layout.gpus] += size
    nodes = [sum(merged[n : n + g]) for n in range(0, layout.gpus, g)]
    largest, expert = m["largest_tensor"], m["expert_tensor"]  # an expert's: whole on its rank
    return {
        "read": held * read,  # into the fp32 shards to_empty allocated: no GPU memory above them
        "read_node": held * read * g,
        "replicas": replicas,
        "read_job": m["read_bytes"] * replicas,  # each replica reads the whole model
        # A slice read, then cast to fp32 on the host: a blocking copy_ to the GPU casts on the CPU.
        "read_host": max(largest / split, expert) * (disk + 4),
        "cast": held * disk,  # the export's copy of the shard in the published dtype, on the GPU
        "written": held * disk / replicas,
        "written_node": held * disk / replicas * g,
        # DCP's writer takes its part of each file to the CPU, and safetensors serializes it: twice.
        "write_host": 2 * max(files) / split,
        "files": files,
        "merged": max(merged),  # read, and as much written
        "merged_node": max(nodes),
        "merging": (sum(map(bool, merged)), sum(map(bool, nodes))),  # GPUs, nodes
        "merge_host": max(largest, expert) * disk * (1 + 1 / split),  # a tensor whole, and a piece read into it
    }

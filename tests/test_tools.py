"""The guide's tools (tools/): the chapter differ, the benchmark, the planner and the plot. The chapters'
run-time code in common/ is tested in test_common.py."""

import ast
import os
import re
import subprocess
import sys

import pytest
from harness import REPO, last_line

from tools.diff import base, chapters, render_block, updated_readme


def test_chapter_readmes_embed_their_current_diff():
    found = chapters()
    assert found[0].name == "01-single-gpu"
    # 07, 08 and 09 build on 04; 10 on 05.
    bases = [base(chapter).name for chapter in found[-5:]]
    assert bases == ["05-tensor-parallel", "04-fsdp", "04-fsdp", "04-fsdp", "05-tensor-parallel"]
    for chapter in found[1:]:
        previous = base(chapter)
        readme = (chapter / "README.md").read_text()
        marker = f"<!-- diff: {previous.name}/train_llm.py {chapter.name}/train_llm.py -->"
        assert marker in readme, f"{chapter.name}/README.md must embed its diff against {previous.name}"
        assert updated_readme(readme) == readme, (
            f"stale diff in {chapter.name}/README.md: run python -m tools.diff --update"
        )


def test_a_module_a_chapter_carries_is_its_sources_copy_or_its_diff_is_embedded():
    """One source per module: a module that an earlier chapter teaches is carried byte for byte (a
    fix to one is a fix to both) or grown, and then its diff from the source is part of the
    chapter's lesson, in its README."""
    from tools.diff import module_sources

    grown = {}
    for chapter in chapters():
        readme = (chapter / "README.md").read_text()
        for name, source in module_sources(chapter).items():
            if (chapter / name).read_bytes() == (source / name).read_bytes():
                continue
            marker = f"<!-- diff: {source.name}/{name} {chapter.name}/{name} -->"
            assert marker in readme, f"{chapter.name}/README.md must embed its {name}'s diff from {source.name}"
            grown[f"{chapter.name}/{name}"] = source.name
    assert grown == {"10-nd-parallel/tp.py": "05-tensor-parallel", "10-nd-parallel/pipeline.py": "08-pipeline-parallel",
                     "10-nd-parallel/experts.py": "09-expert-parallel"}, grown  # fmt: skip


def test_chapters_stay_within_the_guides_sizes():
    """The style guide's limits: a chapter is read top to bottom, so it stays under 600 lines (the
    composed chapter, 10, which carries four chapters' lessons: 700), main() under 260."""
    for chapter in chapters():
        source = (chapter / "train_llm.py").read_text()
        main = next(node for node in ast.parse(source).body if getattr(node, "name", None) == "main")
        limit = 700 if chapter.name == "10-nd-parallel" else 600
        assert len(source.splitlines()) <= limit, f"{chapter.name}/train_llm.py: {len(source.splitlines())} lines"
        assert main.end_lineno - main.lineno + 1 <= 260, (
            f"{chapter.name}: main() has {main.end_lineno - main.lineno + 1}"
        )


def test_stale_diff_is_detected():
    current = render_block("01-single-gpu/train_llm.py", "tests/harness.py")
    assert updated_readme(f"intro\n{current}\nmore") == f"intro\n{current}\nmore"
    stale = current.replace("+", "-", 3)
    assert updated_readme(f"intro\n{stale}\nmore") == f"intro\n{current}\nmore"


def test_diff_command():
    proc = subprocess.run([sys.executable, "-m", "tools.diff", "01", "2"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout.startswith("--- a/01-single-gpu/train_llm.py\n+++ b/02-multi-gpu/train_llm.py\n")
    assert "\n+from torch.nn.parallel import DistributedDataParallel\n" in proc.stdout


def test_diff_command_unknown_chapter():
    proc = subprocess.run([sys.executable, "-m", "tools.diff", "01", "42"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "no chapter '42'" in proc.stderr


def test_benchmark_prints_the_table(tmp_path):
    """One command, several runs: the header, then a row per run with the command that makes it alone."""
    from tools.benchmark import MARKDOWN_HEADER

    runs = {"01 --steps 20 -- --batch-size 2": ["01-single-gpu", "1", "1 × 1", "float32"],
            "05 --nproc 2 --steps 20 -- --tp-size 2": ["05-tensor-parallel", "2", "1 × 2", "float32"]}  # fmt: skip
    cmd = [sys.executable, "-m", "tools.benchmark", "--table", *runs]
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert "\n".join(lines[:2]) == MARKDOWN_HEADER and len(lines) == 2 + len(runs), proc.stdout
    for line, (run, cells) in zip(lines[2:], runs.items()):
        row = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(row) == MARKDOWN_HEADER.splitlines()[0].count("|") - 1, row
        assert row[:4] == cells, row
        assert re.fullmatch(r"[\d,]+", row[4]) and row[6] == "n/a" and re.fullmatch(r"\d+\.\d\d GiB", row[7]), row
        assert re.fullmatch(r"\d+/\d+/\d+", row[8]) and row[9].startswith("CPU"), row
        assert row[10] == f"`python -m tools.benchmark --markdown {run}`", row


@pytest.mark.parametrize(
    "dtype, compiled",
    [("float32", False), ("bfloat16", False), ("bfloat16", True)],
    ids=["fp32", "bf16", "bf16-compiled"],
)
def test_planner_counts_the_activations_hf_llama_saves(dtype, compiled):
    """The planner's activation formula against the bytes HF's Llama really keeps for backward (the
    tensors autograd saves, weights excluded), on the CPU, at Llama-3.2-1B's width with 2 blocks: eager,
    and with each block compiled as the chapters do on GPUs. The backend partitions forward and
    backward as inductor does (which ops backward recomputes), without generating kernels."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tools.plan import activation_bytes

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    if compiled:
        for block in model.model.layers:
            block.compile(backend="aot_eager_decomp_partition")
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    input_ids = torch.randint(0, 512, (2, 128))
    model(input_ids=input_ids, labels=input_ids, use_cache=False)  # compiles, when compiled
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=input_ids, labels=input_ids, use_cache=False)
    widths = {"hidden": 2048, "kv": 512, "mlp": 8192, "vocab": 512, "layers": 2}
    compute_bytes = 4 if dtype == "float32" else 2
    predicted = activation_bytes(widths, 2 * 128, 1, False, compute_bytes, compiled)
    assert sum(saved.values()) == pytest.approx(predicted, rel=0.01)


def live_bytes(existing=frozenset()):
    """A dispatch mode that follows the storage of every tensor the ops under it make: `live`, the bytes
    of those still alive, and `peak`, the most at once. Storages in `existing` (a model's weights, whose
    views ops return) are not counted."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live, self.peak, self.alive = 0, 0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    pointer = storage.data_ptr()
                    if pointer not in self.alive and pointer not in existing:
                        self.alive[pointer] = storage.nbytes()
                        self.live += storage.nbytes()
                        self.peak = max(self.peak, self.live)
                        weakref.finalize(storage, self.free, pointer)
            return out

        def free(self, pointer):
            self.live -= self.alive.pop(pointer, 0)

    return LiveBytes()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_planner_counts_what_each_checkpointing_mode_keeps(mode):
    """After forward, the bytes of every tensor still alive that forward made (what autograd, the
    checkpoints and selective checkpointing's cache keep), with chapter 01's --activation-checkpointing
    options, eager fp32 at Llama-3.2-1B's width with 2 blocks: the planner's activations but the one
    block that backward recomputes at a time (its size is a block's without checkpointing, as the test
    above measures). Without checkpointing, this count equals the test above's (0.1% apart)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from common import checkpoint_blocks, transformer_blocks
    from tools.plan import activation_bytes

    config = LlamaConfig(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
        vocab_size=512, max_position_embeddings=256,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    checkpoint_blocks(transformer_blocks(model), mode)
    input_ids = torch.randint(0, 512, (2, 128))
    existing = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), input_ids]}
    with live_bytes(existing) as counted:
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    widths = {"hidden": 2048, "kv": 512, "mlp": 8192, "vocab": 512, "layers": 2}
    predicted = activation_bytes(widths, 2 * 128, 1, mode, 4, compiled=False)
    # Less the block being recomputed: a block's bytes without checkpointing.
    blocks = {layers: activation_bytes({**widths, "layers": layers}, 256, 1, False, 4, False) for layers in [1, 2]}
    predicted -= blocks[2] - blocks[1]
    assert counted.live == pytest.approx(predicted, rel=0.01), loss  # alive: the graph holds what is counted


def test_planner_counts_what_the_loss_backward_holds():
    """At the start of the loss's backward, where a step peaks, the bytes of all tensors alive beside the
    log-softmax the planner counts as kept: its gradient and the logits', fp32, 8 bytes per logit. Counted
    by following every tensor the loss's forward and backward make, as the chapters compute it (bf16
    logits dropped once the loss has them, HF's loss)."""
    import torch
    from transformers.loss.loss_utils import ForCausalLMLoss

    from tools.plan import loss_backward_bytes

    tokens, vocab, hidden = 256, 32000, 64
    h = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    with live_bytes() as counted:
        loss = ForCausalLMLoss(h @ w.t(), labels, vocab)
        loss.backward()
    log_softmax = tokens * vocab * 4
    gradients = 2 * (h.numel() + w.numel())
    widths = {"vocab": vocab}
    assert counted.peak - log_softmax - gradients == pytest.approx(loss_backward_bytes(widths, tokens, 1), rel=0.01)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--gpus-per-node", "8", "--tp-size", "3"], "--tp-size 3 must divide the 8 GPUs"),
        (["--gpus-per-node", "2", "--tp-size", "4"], "fit in a node of 2"),
        (["--gpus-per-node", "16", "--tp-size", "16"], "must divide the model's attention heads (8)"),
        (["--nodes", "2", "--shard-size", "3"], "--shard-size 3 must divide the 16 dp ranks"),
        (["--pp-size", "3"], "--pp-size 3 must divide the 8 GPUs"),
        (["--pp-size", "4", "--tp-size", "4"], "--pp-size 4 x --tp-size 4 must divide the 8 GPUs"),
        (["--pp-size", "8"], "--pp-size 8 cuts 8 stages: the model needs as many blocks"),
        (["--pp-size", "2", "--batch-size", "2", "--pp-microbatches", "3"], "must divide the pipeline's 4 rows"),
    ],
)
def test_planner_refuses_impossible_layouts(argv, words):
    from tools.plan import main

    with pytest.raises(SystemExit) as exit:
        main([str(REPO / "common" / "tiny_llama"), *argv])
    assert str(exit.value.code).startswith("error: ") and words in str(exit.value.code)


def test_planner_prints_the_simplest_layout_that_fits(capsys):
    from tools.plan import main

    main([str(REPO / "tools" / "llama_1b_shape"), "--gpus-per-node", "8", "--batch-size", "16", "--seq-length", "2048"])
    out = capsys.readouterr().out
    assert "DDP (01-03)" in out and "does not fit" in out
    assert "The simplest that fits: FSDP (04)" in out


def test_planner_matches_torchtitans_published_saving_from_more_gpus():
    """torchtitan's Llama 3.1 8B benchmark (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, Tables 1
    and 3): with FSDP at 2 x 8192 tokens per GPU, the peak per GPU is 15.0 to 15.4 GiB lower on 128 GPUs than on 8.
    The activations are the same on both: the difference is the training state that FSDP shards."""
    from tools.plan import GIB, Layout, count, plan

    m = count(str(REPO / "tools" / "model_shapes" / "llama-3.1-8b"))
    peak = {gpus: plan(m, Layout("FSDP", gpus), 2, 8192, 2, False)["total"] / GIB for gpus in [8, 128]}
    assert 0.9 * 15.0 < peak[8] - peak[128] < 15.4


def test_planner_matches_torchtitans_published_peaks_with_selective_checkpointing():
    """The same torchtitan runs keep, with torch.compile, the outputs of attention and of every other
    matmul (its selective checkpointing, the policy of common/activation_checkpointing.py): 77.0 GiB
    reserved per GPU on 8 GPUs and 62.0 on 128. The planner's allocated bytes lie just under (reserved includes what the
    allocator holds but has not handed out)."""
    from tools.plan import GIB, Layout, count, plan

    m = count(str(REPO / "tools" / "model_shapes" / "llama-3.1-8b"))
    for gpus, reserved in [(8, 77.0), (128, 62.0)]:
        peak = plan(m, Layout("FSDP + SAC", gpus, checkpointing="selective"), 2, 8192, 2, False)["total"] / GIB
        assert 0.9 * reserved < peak < reserved, (gpus, peak)


@pytest.mark.parametrize("nodes", [2, 8])
def test_planner_counts_the_bytes_through_each_nic(nodes, capsys):
    """Llama-3.1-70B on nodes of 8 GPUs, each GPU with its NIC. FSDP over every GPU is one ring that
    enters and leaves each node once per channel, a NIC per channel: a node's 8 NICs carry what one GPU
    sends, 1/8 each. HSDP with a group per node all-reduces each rank's 1/8 of the fp32 gradients with
    one GPU in each other node, through its own NIC, and holds 8x the training state: about as many
    bytes per NIC as FSDP, not 8x fewer. FSDP x TP 8's dp group has one GPU per node: all it sends
    crosses, through that GPU's NIC."""
    from tools.plan import GIB, Layout, count, main, plan

    m = count(str(REPO / "tools" / "model_shapes" / "llama-3.1-70b"))
    p, gpus = m["params"], 8 * nodes
    fsdp = plan(m, Layout("FSDP", gpus), 1, 4096, 2, False)
    hsdp = plan(m, Layout("HSDP", gpus, shard=8), 1, 4096, 2, False)
    tp = plan(m, Layout("FSDP x TP", gpus, tp=8), 8, 4096, 2, False)
    assert hsdp["weights"] == 4 * p / 8 == nodes * fsdp["weights"]
    # By hand: FSDP gathers the bf16 weights twice (the tied-free 70B: all but the head and the root)
    # and reduce-scatters the fp32 gradients, (n - 1) / n of each buffer, over 8 NICs.
    twice = m["layers"] * m["block_params"] + m["embedding"]
    fsdp_bytes = (gpus - 1) / gpus * ((2 * twice + (p - twice)) * 2 + 4 * p)
    assert fsdp["sent_dp"] == pytest.approx(fsdp_bytes) and fsdp["network_per_nic"] == pytest.approx(fsdp_bytes / 8)
    assert fsdp["nvlink_dp"] == 0
    assert hsdp["network_per_nic"] == pytest.approx(2 * (nodes - 1) / nodes * 4 * p / 8)
    assert hsdp["nvlink_dp"] == pytest.approx(fsdp_bytes / 8 * (7 / 8) / ((gpus - 1) / gpus) * 8)
    assert (
        tp["network_per_nic"]
        == pytest.approx(tp["sent_dp"])
        == pytest.approx((nodes - 1) / nodes * (fsdp_bytes * gpus / (gpus - 1)) / 8)
    )
    main([str(REPO / "tools" / "model_shapes" / "llama-3.1-70b"), "--nodes", str(nodes), "--shard-size", "8"])
    out = capsys.readouterr().out
    assert "Per GPU, HSDP over 8, tp 1" in out
    assert f"through each NIC across nodes {hsdp['network_per_nic'] / GIB:.2f} GiB" in out


def test_plot_draws_the_runs_and_refuses_a_folder_without_metrics(tmp_path, chapter_01_reference, ddp_reference):
    """python -m tools.plot, as the README prints it, on chapter 01's and chapter 02's runs."""
    png = tmp_path / "loss_curves.png"
    plot = [sys.executable, "-m", "tools.plot"]
    proc = subprocess.run([*plot, str(chapter_01_reference), str(ddp_reference), "--output", str(png)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    from matplotlib.image import imread

    height, width, _ = imread(png).shape
    assert png.read_bytes().startswith(b"\x89PNG") and width > 100 and height > 100

    empty = tmp_path / "no_run"
    empty.mkdir()
    proc = subprocess.run([*plot, str(empty), "--output", str(tmp_path / "none.png")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert (
        last_line(proc.stderr)
        == f"error: {empty} has no metrics.jsonl: pass a run folder (--save-dir/--experiment-name)"
    )
    assert not (tmp_path / "none.png").exists()


def test_planner_prints_no_alarm_from_libraries_it_does_not_use():
    """torchao, imported with the planner's FP8 filter and by transformers as it builds a model, says
    that kernels no chapter uses do not load; common/ drops those lines (what the chapters print too)."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "tools.plan", str(REPO / "tools" / "llama_1b_shape"), "--gpus-per-node", "1"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True, timeout=600)
    assert "Failed to load" not in proc.stderr and "register_constant" not in proc.stderr, proc.stderr
    assert "The simplest that fits" in proc.stdout


def test_memory_tool_measures_a_real_fsdp_step_beside_the_plan():
    """python -m tools.memory, as the README runs it: chapter 04's step at Llama-3.2-1B's shape on 2 fake
    ranks, under FSDPMemTracker, beside the planner's (eager) figures: the weights, AdamW's moments and
    the activations within 2%. The peak is the loss's backward, before FSDP has made the first sharded
    gradient, which the planner counts as held (as on the H100, README): its total is above, within 15%."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "tools.memory", str(REPO / "tools" / "llama_1b_shape"), "--gpus-per-node", "2"]
    command += ["--batch-size", "1", "--seq-length", "4096"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in proc.stdout.splitlines()[2:8]}
    assert list(rows) == ["weights", "gradients", "optimizer", "gathered", "activations", "total"], proc.stdout
    for name in ["weights", "optimizer", "activations"]:
        measured, planned = rows[name]
        assert measured == pytest.approx(planned, rel=0.02), (name, proc.stdout)
    measured, planned = rows["total"]
    assert measured <= planned <= 1.15 * measured, proc.stdout


def test_memory_tool_measures_an_expert_parallel_step_beside_the_plan(tmp_path):
    """python -m tools.memory --ep-size, as chapter 09's README runs it: Qwen3-30B-A3B's widths (2 of its
    blocks) on 2 x 8 fake ranks, ep 8, under FSDPMemTracker, its all-to-alls' splits even: each rank's
    weights and AdamW's moments are its 16 experts' share (sharded over efsdp 2) and the dense ones',
    as the planner counts them; the activations within 6%. As for chapter 04, the peak is the loss's
    backward, before any gradient exists, which the planner counts as held: its total is above."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(REPO / "tools" / "model_shapes" / "qwen3-30b-a3b")
    config.num_hidden_layers = 2
    config.save_pretrained(tmp_path)
    command = [sys.executable, "-m", "tools.memory", str(tmp_path), "--nodes", "2", "--ep-size", "8"]
    command += ["--batch-size", "2", "--seq-length", "4096", "--activation-checkpointing"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "chapter 09 on 2 x 8 GPUs" in proc.stdout, proc.stdout
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in proc.stdout.splitlines()[2:8]}
    for name in ["weights", "optimizer"]:
        measured, planned = rows[name]
        assert measured == pytest.approx(planned, rel=0.02), (name, proc.stdout)
    measured, planned = rows["activations"]
    assert measured == pytest.approx(planned, rel=0.06), proc.stdout
    measured, planned = rows["total"]
    assert measured <= planned <= 1.15 * measured, proc.stdout


def test_data_prepared_beforehand_is_found_by_the_chapters(tmp_path):
    """python -m tools.prepare fills the cache that a chapter then reads: the chapter tokenizes nothing."""
    from harness import FAST_ARGS, chapter_env, run_chapter

    hf_home = tmp_path / "hf"
    prepare = [sys.executable, "-m", "tools.prepare", "--seq-length", "128"]
    proc = subprocess.run(prepare, env=chapter_env(hf_home), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(1,308,032 tokens)" in proc.stdout and "(4.00 bytes per token)" in proc.stdout, proc.stdout
    run = run_chapter("01-single-gpu", *FAST_ARGS, "--max-steps", "1", "--save-dir", str(tmp_path), hf_home=hf_home)
    assert "Tokenizing" not in run.stderr


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_planner_bubble_is_the_idle_share_of_the_schedule(schedule):
    """The bubble the planner prints, (p - 1) / (m + p - 1), is the share of time each rank idles in the
    schedule's order over time (the timeline it draws: a forward 1 unit, a backward 2, each waiting for its
    neighbour's), for pipelines of 2 to 8 stages and 1 to 8 micro-batches per stage."""
    from tools.plan import Layout, bubble, timeline

    for pp, microbatches in [(2, 2), (2, 7), (4, 4), (4, 8), (8, 8), (8, 64)]:
        lines = timeline(schedule, pp, microbatches)
        assert len({len(line) for line in lines}) == 1 and all(line.count(".") == lines[0].count(".") for line in lines)
        idle = lines[0].count(".") / len(lines[0])
        planned = bubble(Layout("PP", pp, pp=pp, schedule=schedule), microbatches)
        assert idle == pytest.approx(planned), (pp, microbatches)


def test_planner_counts_a_pipeline_stage_by_hand(capsys):
    """Llama-3.1-70B over 8 nodes, pp 8 (a stage per node, 10 blocks each), FSDP over each node's 8 GPUs,
    1F1B, 2 rows per GPU: 16 rows per pipeline step, 16 micro-batches of 1 row. The first stage's GPU holds
    an eighth of its stage's state, and the whole stage gathered (bf16) and its gradients whole (fp32) until
    the last backward; it holds 8 micro-batches' activations (pp - rank), and sends each micro-batch's hidden
    states to the next node, receiving their gradients: 16 x 4096 tokens x 8192 x 2 bytes each way."""
    from tools.plan import GIB, Layout, count, main, plan

    m = count(str(REPO / "tools" / "model_shapes" / "llama-3.1-70b"))
    planned = plan(m, Layout("PP", 64, pp=8), 2, 4096, 2, False)
    stage = m["embedding"] + 10 * m["block_params"]
    assert planned["blocks"] == 10 and planned["microbatches"] == 16 and planned["in_flight"] == 8
    assert planned["weights"] == 4 * stage / 8 and planned["optimizer"] == 8 * stage / 8
    assert planned["gradients"] == 4 * stage + 4 * stage / 8 and planned["gathered"] == 2 * stage
    assert planned["sent_pp"] == planned["sent_pp_each_way"] == 16 * 4096 * 8192 * 2  # the first stage: forward only
    assert planned["sent_dp"] == pytest.approx(7 / 8 * (2 + 4) * stage)  # gathered once, reduce-scattered once
    assert planned["network_per_nic"] == planned["sent_pp"] and planned["bubble"] == pytest.approx(7 / 23)
    last = planned["last stage"]
    assert last["in_flight"] == 1 and last["loss backward"] == 4096 * m["vocab"] * 8
    main([str(REPO / "tools" / "model_shapes" / "llama-3.1-70b"), "--nodes", "8", "--pp-size", "8", "--batch-size", "2",
          "--seq-length", "4096"])  # fmt: skip
    out = capsys.readouterr().out
    assert "pp 8 (1F1B, 16 micro-batches)" in out and "bubble: 30.4% of each step idle" in out
    assert f"each stage {planned['sent_pp_each_way'] / GIB:.3f} GiB to the next and as much back" in out


def test_planner_counts_expert_parallelism_by_hand(capsys):
    """The tiny Qwen3-MoE of common/tiny_moe (4 layers of 8 experts of width 64, 2 per token, hidden
    128) over 2 nodes of 4 GPUs, --ep-size 4 (chapter 09: each node's 4 ranks split a layer's
    experts, 2 each, sharded over efsdp 2, a rank in each node), full checkpointing, 2 rows of 64
    tokens per GPU, bf16. Each number by hand, and what EP changes against FSDP (--ep-size 1): not
    the state per GPU."""
    from tools.plan import GIB, Layout, count, main, plan

    m = count(str(REPO / "common" / "tiny_moe"))
    expert_params = 8 * (2 * 64 * 128 + 128 * 64)  # a layer's: gate_up (E, 2I, H), down (E, H, I)
    assert (m["moe_layers"], m["experts"], m["top_k"], m["expert_width"]) == (4, 8, 2, 64)
    assert m["expert_params"] == expert_params == 196_608
    fsdp = plan(m, Layout("FSDP", 8, checkpointing=True, gpus_per_node=4), 2, 64, 2, False)
    ep = plan(m, Layout("EP", 8, checkpointing=True, gpus_per_node=4, ep=4), 2, 64, 2, False)
    e = ep["experts"]
    tokens = 2 * 64
    # Each token's 2 copies of 128 bf16 numbers, 3/4 to the other 3 ranks; dispatch and combine in
    # forward, backward and the recompute.
    assert e["all_to_all"] == tokens * 2 * 128 * 2 * 3 / 4 * 2 * 3 == 294_912
    # FSDP: gathered twice in bf16, gradients reduce-scattered in fp32, (n - 1) / n of each: EP's 2
    # experts over efsdp 2, or all 8 over the 8 ranks.
    assert e["fsdp_local"] == 1 / 2 * expert_params / 4 * (2 * 2 + 4) == 196_608
    assert e["fsdp_all"] == 7 / 8 * expert_params * (2 * 2 + 4) == 1_376_256
    # EP sends fewer bytes while its all-to-alls (2,304 B a token) cost less than FSDP's it saves.
    assert e["break_even_tokens"] == (1_376_256 - 196_608) / (294_912 / tokens) == 512
    # Whatever ep and the shard group: 3 E I (2 x 2 + 4) / (2 x 3 passes x 2 per token x 2 B).
    assert 3 * 8 * 64 * 8 / (2 * 3 * 2 * 2) == 512
    for gpus, ep_size, shard in [(8, 2, 0), (8, 8, 0), (16, 4, 8), (16, 2, 4)]:
        other = Layout("EP", gpus, checkpointing=True, shard=shard, ep=ep_size)
        assert plan(m, other, 2, 64, 2, False)["experts"]["break_even_tokens"] == pytest.approx(512)
    assert e["weights"] == e["gradients"] == 4 * 4 * expert_params / 8
    assert e["optimizer"] == 2 * e["weights"]
    assert all(ep[key] == fsdp[key] for key in ("weights", "gradients", "optimizer", "activations"))
    # FSDP holds two blocks gathered: each with 2 experts of 8 under EP.
    assert fsdp["gathered"] - ep["gathered"] == 2 * expert_params * 3 / 4 * 2
    assert ep["sent_ep"] == 4 * 294_912 and fsdp["sent_ep"] == 0
    assert ep["sent_experts_fsdp"] == 4 * 196_608
    assert fsdp["sent_dp"] - ep["sent_dp"] == pytest.approx(4 * (1_376_256 - 196_608))
    # The efsdp pairs cross the nodes, one GPU of each per node: all they send goes through its NIC.
    # The ep ranks are a node's: their all-to-alls stay on NVLink. On nodes of 2, 2 of the 3 peers
    # are in the other node.
    assert ep["network_per_nic"] - fsdp["network_per_nic"] == pytest.approx(
        4 * 196_608 - 4 * 1_376_256 / 4
    )
    assert ep["network_ep"] == 0
    two = plan(m, Layout("EP", 8, checkpointing=True, gpus_per_node=2, ep=4), 2, 64, 2, False)
    assert two["network_ep"] == pytest.approx(4 * 294_912 * 2 / 3)

    main([str(REPO / "common" / "tiny_moe"), "--nodes", "2", "--gpus-per-node", "4",
          "--ep-size", "4", "--batch-size", "2", "--seq-length", "64",
          "--activation-checkpointing"])  # fmt: skip
    out = capsys.readouterr().out
    assert "Per GPU, FSDP, tp 1, ep 4, full AC:" in out
    assert "Experts, EP 4 (09), mesh 1 x 2 x 4 (replicate, efsdp, ep): 4 layers of 8" in out
    assert "x 2 (dispatch, combine) x 3 (forward, backward, recompute)" in out
    assert "fewer bytes than FSDP below 512 tokens per GPU per micro-step (here 128)" in out
    assert "FSDP x EP 4 (09) + AC" in out and f"{ep['sent_dp'] / GIB:.2f} GiB per GPU" in out


def test_planner_counts_qwen3_30b_a3b_expert_parallel(capsys):
    """Qwen3-30B-A3B (48 layers of 128 experts of width 768, 8 per token, hidden 2048) over 2 nodes
    of 8, --ep-size 8, 2 x 4,096 tokens per GPU with full checkpointing: each layer's 16 local
    experts gathered over efsdp 2 and 8,192 tokens' copies sent, against all 128 gathered over 16
    ranks. EP sends fewer bytes below 24,576 tokens per GPU; it holds the same state as FSDP."""
    from tools.plan import main

    main([str(REPO / "tools" / "model_shapes" / "qwen3-30b-a3b"), "--nodes", "2",
          "--gpus-per-node", "8", "--ep-size", "8", "--batch-size", "2", "--seq-length", "4096",
          "--activation-checkpointing"])  # fmt: skip
    out = capsys.readouterr().out
    assert "48 layers of 128, 8 per token, each 3 x 2048 x 768 (0.60B per layer" in out
    assert "weights 6.75 GiB, gradients 6.75 GiB, optimizer 13.50 GiB, as FSDP over 16" in out
    assert "(forward, backward, recompute): 1.31 GiB" in out and "efsdp 2" in out
    assert "EP in all 1.59 GiB, against FSDP of all 128 over 16 ranks (no EP) 4.22 GiB" in out
    assert "below 24,576 tokens per GPU per micro-step (here 8,192)" in out


def test_planner_counts_a_start_from_published_weights_and_an_export_by_hand(capsys):
    """Llama-3.1-70B (bf16 on disk, untied: its largest tensors the embeddings and the head, 128,256
    x 8,192) over 4 nodes of 8. FSDP: each GPU reads its 1/32 of the model into its shards and
    writes as much; a node 1/4, at 2 GB/s. HSDP with a group per node: each GPU reads its 1/8, every
    node the whole model, the job 4 models; DCP still writes each shard once, 1/32 per GPU. The
    merge: file i on rank i, so the 28 files of <= 5 GiB land on ranks 1-28, 8 on node 1 (8-15)."""
    import itertools

    from tools.plan import GIB, Layout, count, main, plan, published_io

    m = count(str(REPO / "tools" / "model_shapes" / "llama-3.1-70b"))
    p, model, head = m["params"], 2 * m["params"], 128_256 * 8192
    fsdp = published_io(m, Layout("FSDP", 32), plan(m, Layout("FSDP", 32), 1, 4096, 2, False))
    assert fsdp["read"] == fsdp["cast"] == fsdp["written"] == model / 32
    assert fsdp["read_node"] == fsdp["written_node"] == model / 4 and fsdp["read_job"] == model
    assert fsdp["read_host"] == head / 32 * (2 + 4)  # a slice in bf16, and its fp32 cast
    assert fsdp["merge_host"] == head * 2 * (1 + 1 / 32)  # the head whole, and a piece of it
    files = fsdp["files"]
    assert len(files) == 28 and sum(files) == model and max(files) <= 5 * GIB
    # Whole tensors in order, each file closed by the tensor that would take it past 5 GiB.
    sizes = [2 * numel for numel in m["tensors"]]
    tensors_before = {end: j for j, end in enumerate(itertools.accumulate(sizes), 1)}
    for end, file in zip(itertools.accumulate(files[:-1]), files):
        assert file + sizes[tensors_before[end]] > 5 * GIB
    assert fsdp["write_host"] == 2 * max(files) / 32
    assert fsdp["merged"] == max(files) and fsdp["merging"] == (28, 4)
    assert fsdp["merged_node"] == sum(files[7:15])  # ranks 8-15, node 1: a file each
    hsdp = Layout("HSDP", 32, shard=8)
    hsdp = published_io(m, hsdp, plan(m, hsdp, 1, 4096, 2, False))
    assert hsdp["read"] == hsdp["cast"] == model / 8 and hsdp["read_node"] == model
    assert hsdp["read_job"] == 4 * model and hsdp["written"] == model / 32
    assert hsdp["read_host"] == head / 8 * 6
    tp = Layout("FSDP x TP", 32, tp=8)
    tp = published_io(m, tp, plan(m, tp, 8, 4096, 2, False))
    assert tp["read"] == tp["written"] == model / 32 and tp["read_host"] == fsdp["read_host"]

    main([str(REPO / "tools" / "model_shapes" / "llama-3.1-70b"), "--nodes", "4"])
    out = capsys.readouterr().out
    assert "Published weights (04-10), bfloat16 safetensors; shared storage at 2 GB/s per" in out
    read = f"reads its own slices: {model / 32 / GIB:.2f} GiB, a node {model / 4 / GIB:.2f} GiB"
    assert f"{read} ({model / 4 / 2e9:.1f} s)" in out
    assert "then 28 files of <= 5 GiB, merged by 28 GPUs on 4 nodes" in out
    export = (model / 4 + 2 * sum(files[7:15])) / 2e9
    assert f"in all, at best: {model / 4 / 2e9:.1f} s to start, {export:.1f} s to export" in out
    assert f"before, rank 0 alone: {4 * p / GIB:.1f} GiB of fp32 on its host" in out
    main([str(REPO / "tools" / "model_shapes" / "llama-3.1-70b"), "--nodes", "4",
          "--storage-gbps", "4"])  # fmt: skip
    assert f"{read} ({model / 4 / 4e9:.1f} s)" in capsys.readouterr().out


def test_planner_counts_published_experts_by_hand(capsys):
    """Qwen3-30B-A3B over 2 nodes of 8 at --ep-size 8: every tensor split over the 16 GPUs (the
    experts over ep 8 x efsdp 2), so each reads and writes 1/16 of the model. Published, its experts
    are one tensor each (768 x 2048: gate, up, down), each read whole by the rank that holds it,
    and its largest tensors the embeddings and the head, 151,936 x 2,048, split over the 16. In
    tensors of at most 151,936 x 2,048, 12 files: ranks 1-7 on node 0 merge 7 of them, ranks 8-12
    on node 1 the other 5. DeepSeek-V3's stacked gate_up_proj (15 GiB a layer) is 512 tensors."""
    from tools.plan import GIB, Layout, count, export_files, main, plan, published_io

    m = count(str(REPO / "tools" / "model_shapes" / "qwen3-30b-a3b"))
    model, embeddings = 2 * m["params"], 151_936 * 2048
    assert (m["largest_tensor"], m["expert_tensor"]) == (embeddings, 768 * 2048)
    assert len(m["published"]) == len(m["tensors"]) + 48 * (3 * 128 - 2)  # two stacked per layer
    ep = Layout("EP", 16, checkpointing=True, ep=8)
    io = published_io(m, ep, plan(m, ep, 2, 4096, 2, False))
    assert io["read"] == io["cast"] == io["written"] == model / 16 and io["read_node"] == model / 2
    assert io["read_host"] == embeddings / 16 * 6 and io["merge_host"] == embeddings * 2 * (1 + 1 / 16)
    files = io["files"]
    assert len(files) == 12 and sum(files) == model and io["merging"] == (12, 2)
    assert io["merged_node"] == sum(files[:7]) and max(files) <= 5 * GIB

    main([str(REPO / "tools" / "model_shapes" / "qwen3-30b-a3b"), "--nodes", "2",
          "--ep-size", "8"])  # fmt: skip
    out = capsys.readouterr().out
    assert f"each GPU reads its own slices: {model / 16 / GIB:.2f} GiB, a node " in out
    assert f"host {embeddings / 16 * 6 / GIB:.2f} GiB per GPU (its largest slice" in out
    deepseek = count(str(REPO / "tools" / "model_shapes" / "deepseek-v3"))
    assert len(deepseek["published"]) == len(deepseek["tensors"]) + 58 * (3 * 256 - 2)
    assert max(export_files(deepseek)) <= 5 * GIB


@pytest.mark.parametrize(
    "model, argv, words",
    [
        ("tiny_llama", ["--ep-size", "2"], "--ep-size 2: a dense model (no layer of routed"),
        ("tiny_moe", ["--ep-size", "3"], "--ep-size 3 must divide the ranks that shard the model"),
        ("tiny_moe", ["--nodes", "2", "--shard-size", "4", "--ep-size", "8"],
         "--ep-size 8 must divide the ranks that shard the model (4)"),
        ("tiny_moe", ["--nodes", "2", "--ep-size", "16"], "--ep-size 16 must divide the model's 8"),
        ("tiny_moe", ["--ep-size", "2", "--tp-size", "2"], "--ep-size 2 is chapter 09's, built on"),
        ("tiny_moe", ["--ep-size", "2", "--ddp"], "without --tp-size, --cp-size, --pp-size or"),
        ("tiny_moe", ["--ep-size", "2", "--fp8"], "built on 04: without --fp8"),
    ],
)  # fmt: skip
def test_planner_refuses_impossible_expert_parallelism(model, argv, words):
    from tools.plan import main

    with pytest.raises(SystemExit) as exit:
        main([str(REPO / "common" / model), *argv])
    assert str(exit.value.code).startswith("error: ") and words in str(exit.value.code)


def test_planner_says_nothing_of_experts_for_a_dense_model(capsys):
    """A dense model counts no expert, and its plan and output are those of before --ep-size: no
    experts' section, no EP layout, nothing sent by all-to-all."""
    from tools.plan import Layout, count, main, plan

    m = count(str(REPO / "tools" / "model_shapes" / "llama-3.1-8b"))
    assert (m["moe_layers"], m["experts"], m["top_k"], m["expert_params"]) == (0, 0, 0, 0)
    planned = plan(m, Layout("FSDP", 16), 2, 4096, 2, False)
    assert "experts" not in planned and planned["sent_ep"] == planned["sent_experts_fsdp"] == 0
    main([str(REPO / "tools" / "model_shapes" / "llama-3.1-8b"), "--nodes", "2",
          "--batch-size", "2", "--seq-length", "4096"])  # fmt: skip
    out = capsys.readouterr().out
    assert "Per GPU, FSDP, tp 1:\n" in out and "xpert" not in out and "EP" not in out, out
    layouts = out.split("Layouts")[1].splitlines()[1:]
    names = [line.split("  ")[1] for line in layouts if line.startswith("  ")]
    assert names == [
        "DDP (01-03)", "FSDP (04)", "FSDP (04) + SAC", "FSDP (04) + AC", "HSDP (04)",
        *[f"FSDP x TP {tp} (05){ac}" for tp in (2, 4, 8) for ac in ("", " + SAC", " + AC")],
        *[f"FSDP x CP {cp} (07) + AC" for cp in (2, 4, 8)],
        "FSDP x PP 2 (08)", "FSDP x PP 2 (08) + AC",
        "FSDP x TP 8 x PP 2 (10) + AC", "FSDP x TP 8 x CP 2 (10) + AC",
    ]  # fmt: skip

def test_planner_puts_a_ceiling_on_fp8_above_what_an_h100_measured(capsys):
    """FP8's ceiling by torchao's roofline model, for the runs BENCHMARKS.md measured on one H100 (2026-11-26):
    Llama-3.2-1B's shape at 8 x 2048 tokens (bf16 at 47.3% MFU) at most 1.15x, where FP8 measured 1.056x; 3B's
    at 2 x 2048 with full checkpointing (30.6% MFU) at most 1.12x, where it measured 0.90x. More tokens per
    step make the converted matmuls a larger share, and a model with no layer in FP8 gains nothing."""
    from tools.plan import Layout, count, fp8_ceiling, main

    one_gpu, shapes = Layout("FSDP", 1), REPO / "tools" / "model_shapes"
    small = fp8_ceiling(count(str(REPO / "tools" / "llama_1b_shape")), one_gpu, 8, 2048, 0.473)
    assert round(small["ceiling"], 2) == 1.15 and small["fp8"] < small["bf16"] < small["step"]
    full_ac = Layout("FSDP + AC", 1, checkpointing=True)
    m = count(str(shapes / "llama-3.2-3b"))
    assert round(fp8_ceiling(m, full_ac, 2, 2048, 0.306)["ceiling"], 2) == 1.12
    assert fp8_ceiling(m, full_ac, 8, 2048, 0.306)["ceiling"] > fp8_ceiling(m, full_ac, 2, 2048, 0.306)["ceiling"]
    assert fp8_ceiling(count(str(REPO / "common" / "tiny_llama")), one_gpu, 8, 128, 0.45)["ceiling"] == 1.0
    main([str(REPO / "tools" / "llama_1b_shape"), "--gpus-per-node", "1", "--batch-size", "8", "--seq-length", "2048",
          "--fp8", "--mfu", "0.473"])  # fmt: skip
    assert "at most 1.15x the bf16 throughput" in capsys.readouterr().out

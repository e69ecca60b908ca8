"""The planner on chapter 10's composed layouts (FSDP/HSDP x TP x CP x PP on one mesh): the single
chapters' plans it reduces to, one small layout counted by hand, the layouts chapter 10 refuses, and
what it prints for torchtitan's 3-D Llama-3.1-405B and for Llama-3.1-70B at 128k tokens per row.
Nothing is trained: each test reads configs and counts (seconds)."""

import dataclasses
import re
import subprocess
import sys

import pytest
from harness import REPO

SHAPES = REPO / "tools" / "model_shapes"


def test_tp_x_cp_is_chapter_05_on_shorter_rows_with_chapter_07s_ring():
    """Without pp, chapter 10's FSDP x TP x CP is chapter 05's FSDP x TP on rows cp times shorter
    (each GPU computes seq / cp tokens of each row, with FSDP over dp x cp ranks, as chapter 05's
    over as many dp ranks), plus chapter 07's ring on the tp rank's own key/value heads (chapter
    07's plan of a model with kv / tp key/value widths). --shard-size counts dp ranks (dp_shard): 2
    of 4 dp ranks, x cp 2, shard each tensor over 4 ranks, as chapter 05's --shard-size 4 of 8 dp
    ranks. --fp8 is not chapter 10's: the composed plan ignores it."""
    from tools.plan import Layout, count, plan

    m = count(str(SHAPES / "llama-3.1-8b"))
    keys = [
        "weights",
        "gradients",
        "optimizer",
        "gathered",
        "activations",
        "loss backward",
        "total",
    ]
    keys += ["sent_dp", "sent_replicate", "network_per_nic", "nvlink_dp", "sent_tp"]
    for shard, chapter_05_shard in [(0, 0), (2, 4)]:
        composed = Layout("TP x CP", 32, tp=4, cp=2, shard=shard, checkpointing=True)
        tp_only = Layout("TP", 32, tp=4, shard=chapter_05_shard, checkpointing=True)
        for batch, seq in [(1, 8192), (2, 4096)]:
            planned = plan(m, composed, batch, seq, 2, fp8=True)
            assert planned == plan(m, composed, batch, seq, 2, fp8=False)
            chapter_05 = plan(m, tp_only, batch, seq // 2, 2, fp8=False)
            assert {k: planned[k] for k in keys} == pytest.approx(
                {k: chapter_05[k] for k in keys}
            ), shard
            ring = Layout(
                "CP", 16, cp=2, checkpointing=True
            )  # 07 has no tp: its kv heads / tp instead
            chapter_07 = plan({**m, "kv": m["kv"] // 4}, ring, batch, seq, 2, fp8=False)
            assert planned["sent_cp"] == chapter_07["sent_cp"] > 0


def test_a_pipeline_alone_is_chapter_08_and_its_stages_add_up_to_the_plan_without_pp():
    """With tp = cp = 1, chapter 10's pipeline is chapter 08's: the same stages, schedule, state and
    sends, for the same rows: a pipeline of pp ranks trains pp x --batch-size rows in both. With tp
    and cp, the two stages of a pp 2 pipeline together hold the whole model's
    state and gathered weights (/ tp) and send over tp and cp what the layout without pp sends for
    each micro-batch's rows, micro-batch by micro-batch; each stage sends each micro-batch's hidden
    states, seq / cp / tp tokens of each row (sequence parallel's slice)."""
    from tools.plan import Layout, count, pipeline_plan, pipeline_rows, plan

    m = count(str(SHAPES / "llama-3.1-70b"))
    for schedule in ["1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS"]:
        chapter_08 = Layout("PP", 64, pp=4, schedule=schedule, checkpointing=True)
        assert pipeline_rows(chapter_08, 2) == 8
        assert plan(m, chapter_08, 2, 4096, 2, False) == pipeline_plan(
            m, chapter_08, 8, 4096, 2, True
        )

    layout = Layout("PP x TP x CP", 64, tp=4, cp=2, pp=2, checkpointing="selective")
    assert pipeline_rows(layout, 4) == 8  # the dp rank's rows: pp x --batch-size
    planned = plan(m, layout, 4, 4096, 2, False)
    first, last = planned, planned["last stage"]
    assert planned["microbatches"] == 8 and planned["tokens_per_microbatch"] == 2048
    flat = plan(
        m, dataclasses.replace(layout, pp=1, gpus=32), 1, 4096, 2, False
    )  # a micro-batch's row
    for key in ["weights", "optimizer"]:
        assert first[key] + last[key] == pytest.approx(flat[key])
    assert first["gathered"] + last["gathered"] == pytest.approx(2 * m["params"] / 4)
    # The embeddings' gradient, whole on every tp rank of the first stage (its 3/4 more).
    # And on each stage, at its last micro-batch's end, a block's gradients in bf16 and fp32.
    assert first["gradients"] + last["gradients"] == pytest.approx(
        4 * m["params"] / 4 * (1 + 1 / 8) + 4 * m["embedding"] * 3 / 4 + 2 * 6 * m["block_params"] / 4
    )
    for key in ["sent_tp", "sent_cp"]:
        assert first[key] + last[key] == pytest.approx(8 * flat[key])
    assert first["sent_pp"] == last["sent_pp"] == 8 * 1 * 4096 / 2 / 4 * m["hidden"] * 2


def test_a_small_composed_layout_by_hand(tmp_path):
    """A Llama of hidden 64, MLP 128, 4 heads and 2 key/value heads of 16, 4 blocks, vocabulary 256,
    untied, on 4 nodes of 4 GPUs: pp 2 x dp 2 x cp 2 x tp 2, full checkpointing, 1F1B, --batch-size
    2: 4 rows of 64 tokens per dp rank (4 micro-batches of 1 row), bf16, compiled.

    Parameters: embeddings and head 256 x 64 = 16,384 each; a block 36,992 (q and o 64 x 64, k and v
    64 x 32, gate, up and down 64 x 128, two norms of 64); the final norm 64. Stage 0: the
    embeddings and blocks 0-1, 90,368; stage 1: blocks 2-3, the norm and the head, 90,432.
    Mesh (pp, dp_replicate, dp_shard, cp, tp) = (2, 1, 2, 2, 2): a stage on 8 GPUs, two nodes; FSDP
    over dp_shard x cp = 4 ranks, 2 apart, 2 in each node; tp pairs and cp's ring in a node.
    First stage's GPU:
    - weights 4 x 90,368 / (4 x 2) = 45,184; optimizer twice; gathered 2 x 90,368 / 2 = 90,368;
      gradients whole (fp32, / tp) and sharded: 4 x 90,368 / 2 x (1 + 1/4) = 225,920, and the
      embeddings' whole on each tp rank (DTensor makes it whole): 4 x 16,384 / 2 more, and at the
      last micro-batch's end a block's in bf16 and fp32 (its reduce-scatter's copy): 6 x 36,992 / 2,
      369,664.
    - a micro-batch: 1 row x 64 / cp = 32 tokens on a GPU. Full AC keeps h x 2 / tp = 64 bytes per
      token and block; one block recomputed holds ((6 x 64 + 2 x 32 + 3 x 128) x 2 - 2 x 64 x 2) / 2
      + 2 x 64 x 2 = 960 per token. 1F1B's first rank holds pp - 0 = 2 micro-batches of its 2
      blocks: 32 x (2 x 2 x 64 + 960) = 38,912.
    - sends: FSDP 3/4 x (2 + 4) x 90,368 / 2 = 203,328, half through each NIC (2 of the group's
      GPUs per node): 101,664. TP per micro-batch 1/2 x 32 x 64 x (2 blocks x (16 + 6, full
      checkpointing's recompute: both all-gathers and attention's reduce-scatter) + 2 x 2, the
      embeddings' two), x 4 = 196,608. CP's ring per micro-batch and block: 32 tokens x 2 x 16 (the
      tp rank's key/value width), x (3 passes x 1 x 2 B + 2 x 4 B for the gradients) = 14,336, x 2
      blocks x 4 = 114,688. PP: each micro-batch's 32 / tp = 16 tokens x 64 x 2 B = 2,048 on, x 4 =
      8,192, through this GPU's NIC (a stage fills a node).
    Last stage's GPU: 1 micro-batch in flight, its final norm and log-softmax ((64 x 4 + 2 x 64 x 2)
    / 2 + 256 x 4 / 2 = 768 per token) and the loss's backward 32 x 256 x 8 / 2 = 32,768; the
    gradients' sends back, 8,192. Bubble: 1 / (4 + 1).
    On nodes of 2, cp's ring (2 ranks, tp = 2 apart) crosses nodes: all of it through the NIC."""
    from transformers import LlamaConfig

    from tools.plan import Layout, count, mesh_groups, plan

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=256,
                tie_word_embeddings=False).save_pretrained(tmp_path)  # fmt: skip
    m = count(str(tmp_path))
    assert (m["params"], m["block_params"], m["embedding"]) == (180_800, 36_992, 16_384)
    layout = Layout("10", 16, tp=2, cp=2, pp=2, checkpointing=True, gpus_per_node=4)
    planned = plan(m, layout, 2, 64, 2, False)
    first, last = planned, planned["last stage"]
    assert planned["microbatches"] == 4 and planned["bubble"] == pytest.approx(0.2)
    assert (first["in_flight"], last["in_flight"], first["blocks"], last["blocks"]) == (2, 1, 2, 2)
    assert (
        first["weights"] == 45_184 and first["optimizer"] == 90_368 and first["gathered"] == 90_368
    )
    assert first["gradients"] == 369_664 and first["activations"] == 38_912
    assert first["loss backward"] == 0 and first["first stage total"] == 634_496
    assert last["weights"] == 45_216 and last["gradients"] == 337_056 and last["gathered"] == 90_432
    assert (
        last["activations"] == 32 * (2 * 64 + 768 + 960) == 59_392
        and last["loss backward"] == 32_768
    )
    assert last["total"] == planned["total"] == 655_296
    assert mesh_groups(layout) == {  # each dimension's ranks, and how far apart they lie
        "shard": (4, 2), "replicate": (1, 8), "tp": (2, 1), "cp": (2, 2), "pp": (2, 8),
    }  # fmt: skip
    assert (first["sent_shard"], first["network_shard"]) == (203_328, 101_664)
    assert first["sent_replicate"] == first["network_replicate"] == 0
    assert (first["sent_tp"], first["sent_cp"], first["network_cp"]) == (196_608, 114_688, 0)
    assert first["sent_pp"] == first["network_pp"] == 8_192
    assert first["network_per_nic"] == 8_192 + 101_664
    assert last["sent_pp"] == 8_192 and last["sent_shard"] == 3 / 4 * 6 * 90_432 / 2
    narrow = plan(m, dataclasses.replace(layout, gpus_per_node=2), 2, 64, 2, False)
    assert narrow["sent_cp"] == narrow["network_cp"] == 114_688


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--pp-size", "2", "--tp-size", "2", "--cp-size", "4"],
         "--pp-size 2 x --tp-size 2 x --cp-size 4 must divide the 8 GPUs"),
        (["--nodes", "2", "--gpus-per-node", "4", "--pp-size", "2", "--tp-size", "8"],
         "fit in a node of 4"),
        (["--tp-size", "2", "--cp-size", "4", "--seq-length", "100"],
         "2 x --cp-size the --seq-length (100)"),
        (["--nodes", "2", "--tp-size", "8", "--cp-size", "2"],
         "must divide the model's key/value heads (4)"),
        (["--tp-size", "4", "--cp-size", "2", "--seq-length", "20"],
         "--tp-size 4 must divide each cp rank's 10 tokens of a row"),
        (["--pp-size", "4", "--tp-size", "2", "--pp-schedule", "Interleaved1F1B",
          "--batch-size", "8"], "--pp-size 4 cuts 8 stages: the model needs as many blocks"),
        (["--pp-size", "2", "--tp-size", "2", "--batch-size", "2", "--pp-microbatches", "3"],
         "--pp-microbatches 3 must divide the pipeline's 4 rows (--pp-size x --batch-size)"),
        (["--pp-size", "2", "--tp-size", "2", "--batch-size", "3", "--pp-microbatches", "3",
          "--pp-schedule", "Interleaved1F1B"], "needs a multiple of --pp-size micro-batches"),
        (["--nodes", "2", "--tp-size", "2", "--cp-size", "2", "--shard-size", "3"],
         "--shard-size 3 must divide the 4 dp ranks"),
        (["--tp-size", "2", "--cp-size", "2", "--fp8"], "--fp8 is chapter 06's (FSDP x TP)"),
        (["--tp-size", "2", "--cp-size", "2", "--ddp"], "shards with FSDP: without --ddp"),
    ],
)  # fmt: skip
def test_the_planner_refuses_what_chapter_10_refuses(argv, words):
    from tools.plan import main

    with pytest.raises(SystemExit) as exit:
        main([str(REPO / "common" / "tiny_llama"), *argv])
    assert str(exit.value.code).startswith("error: ") and words in str(exit.value.code)


def test_a_pipeline_needs_untied_embeddings(tmp_path):
    from transformers import LlamaConfig

    from tools.plan import main

    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                vocab_size=256, tie_word_embeddings=True).save_pretrained(tmp_path)  # fmt: skip
    with pytest.raises(SystemExit) as exit:
        main([str(tmp_path), "--pp-size", "2", "--tp-size", "2", "--batch-size", "2"])
    assert "and untied embeddings" in str(exit.value.code)


def test_composed_layouts_are_offered_on_several_nodes():
    """A dense model's: TP over a node with PP or CP over the nodes; a mixture's: PP over the nodes,
    EP over a stage's ranks as far as 8 nodes; each one chapter 10 runs (tools.plan.check)."""
    from tools.plan import check, count, layouts

    def names(gpus, experts=0):
        return [layout.name for layout in layouts(gpus, 8, experts) if "(10)" in layout.name]

    assert names(8) == [] and names(8, experts=128) == []
    assert names(64) == [f"FSDP x TP 8 x PP {pp} (10) + AC" for pp in (2, 4, 8)] + [
        f"FSDP x TP 8 x CP {cp} (10) + AC" for cp in (2, 4, 8)
    ]
    assert names(64, experts=128) == [f"FSDP x PP {pp} x EP {64 // pp} (10) + AC" for pp in (2, 4, 8)]
    deepseek = count(str(SHAPES / "deepseek-v3"))
    offered = [layout for layout in layouts(512, 8, deepseek["experts"]) if "(10)" in layout.name]
    assert [layout.name for layout in offered] == [
        *[f"FSDP x PP {pp} x EP 64 (10) + AC" for pp in (2, 4, 8)], "FSDP x PP 16 x EP 32 (10) + AC"
    ]
    assert [check(deepseek, layout, 8, 4096, batch_size=1) for layout in offered] == [None] * 4


def test_the_layout_table_counts_what_crosses_the_nodes_on_the_busiest_stage(capsys):
    """Its NIC column: the all-to-alls of an ep group wider than a node too (DeepSeek-V3 at PP 8 x EP
    64: most of what crosses them), each stage's, the largest."""
    from tools.plan import Layout, count, main, plan

    argv = ["--nodes", "64", "--batch-size", "1", "--seq-length", "4096", "--activation-checkpointing"]
    main([str(SHAPES / "deepseek-v3"), *argv])
    row = next(line for line in capsys.readouterr().out.splitlines() if "FSDP x PP 8 x EP 64 (10)" in line)
    deepseek = count(str(SHAPES / "deepseek-v3"))
    layout = Layout("", 512, checkpointing=True, pp=8, ep=64)
    stages = plan(deepseek, layout, 1, 4096, 2, False)["stages"]
    nic = max(s["network_per_nic"] + s["network_cp"] + s["network_ep"] for s in stages)
    assert all(s["network_ep"] > s["network_per_nic"] for s in stages[1:])
    assert f"{nic / 2**30:8.1f} GiB  fits" in row, row


def test_llama_405b_on_torchtitans_3d_layout(capsys):
    """Llama-3.1-405B (126 blocks) on 64 nodes of 8: pp 8 (stages of 16 blocks, the last two of 15),
    TP 8 in each node, FSDP over the 8 nodes of each stage (one GPU in each), full checkpointing,
    --batch-size 2: 16 rows of 8,192 tokens per dp rank (8 x 2), 1F1B: 16 micro-batches of one row. The first stage's GPU holds
    its stage's 1/8 gathered in bf16 and its fp32 gradients whole, and sends its 1/8 of a row's
    hidden states per micro-batch to the next stage's node. FSDP's group has a GPU per node: all it
    sends goes through that GPU's NIC. Of the chapters' layouts, this is the simplest that fits."""
    from tools.plan import GIB, count, main

    m = count(str(SHAPES / "llama-3.1-405b"))
    assert (m["params"], m["layers"], m["hidden"], m["tied"]) == (
        405_853_388_800,
        126,
        16_384,
        False,
    )
    main([str(SHAPES / "llama-3.1-405b"), "--nodes", "64", "--pp-size", "8", "--tp-size", "8",
          "--batch-size", "2", "--seq-length", "8192", "--activation-checkpointing"])  # fmt: skip
    out = capsys.readouterr().out
    print(out)
    stage = m["embedding"] + 16 * m["block_params"]
    assert "chapter 10's mesh pp 8 x dp_replicate 1 x dp_shard 8 x cp 1 x tp 8" in out
    assert "pipeline: 1F1B, the dp rank's 16 rows in 16 micro-batches of 1 x 8192 tokens" in out
    assert f"weights       {4 * stage / 64 / GIB:8.2f} GiB" in out
    whole_embedding = 4 * m["embedding"] * 7 / 8  # its gradient made whole on every tp rank
    reducing = 6 * m["block_params"] / 8  # a block's, in bf16 and fp32, at the last backward's end
    gradients = 4 * stage / 8 * (1 + 1 / 8) + whole_embedding + reducing
    assert f"gradients     {gradients / GIB:8.2f} GiB" in out
    assert f"gathered      {2 * stage / 8 / GIB:8.2f} GiB" in out
    fsdp = 7 / 8 * 6 * stage / 8 / GIB
    assert f"dp_shard x cp (FSDP)       8     8    8 nodes {fsdp:12.2f} {fsdp:7.2f}" in out
    assert (
        f"pp (stage to stage)        8    64    8 nodes {16 * 8192 * 16384 * 2 / 8 / GIB:12.2f}"
        in out
    )
    assert "bubble: 30.4% of each step idle" in out
    # By memory, FSDP x TP 2 with full checkpointing fits the same 128 rows per step too; but its
    # FSDP spans 64 nodes: 376 GiB through each NIC per step, against 33 GiB here.
    assert "The simplest that fits: FSDP x TP 2 (05) + AC." in out
    assert re.search(r"FSDP x TP 2 \(05\) \+ AC +66\.5 GiB +376\.0 GiB  fits", out), out
    assert re.search(r"FSDP x TP 8 x PP 8 \(10\) \+ AC +63\.5 GiB +33\.0 GiB  fits", out), out


def test_llama_70b_at_128k_tokens_per_row_with_tp_and_cp(capsys):
    """Llama-3.1-70B, one row of 131,072 tokens per dp rank, on 4 nodes of 8: TP 8 in each node, CP
    4 across the nodes (a node's tp group per cp rank), FSDP over the 4 cp ranks, full
    checkpointing. Each GPU computes 32,768 tokens; its ring sends its tp rank's keys and values (1
    of 8 key/value heads of 128) per block: 32,768 x 2 x 128 values, 3 passes x 3 hops in bf16 and 4
    hops of fp32 gradients, 80 blocks, all through its NIC (each cp rank in another node)."""
    from tools.plan import GIB, main

    main([str(SHAPES / "llama-3.1-70b"), "--nodes", "4", "--tp-size", "8", "--cp-size", "4",
          "--batch-size", "1", "--seq-length", "131072", "--activation-checkpointing"])  # fmt: skip
    out = capsys.readouterr().out
    print(out)
    ring = 80 * 32_768 * 2 * 128 * (3 * 3 * 2 + 4 * 4) / GIB
    assert "chapter 10's mesh pp 1 x dp_replicate 1 x dp_shard 1 x cp 4 x tp 8" in out
    assert f"cp (ring attention)        4     8    4 nodes {ring:12.2f} {ring:7.2f}" in out
    assert "tp                         8     1     a node" in out
    assert "FSDP x TP 8 x CP 4 (10) + AC" in out


def test_the_planner_puts_no_chapter_folder_on_sys_path():
    """tools/ loads each chapter rule it follows from its file (tools/chapters.py): importing the
    planner leaves sys.path and the chapters' module names (published, tp, pipeline) as they were,
    and a module loaded finds its own chapter's neighbours (06's torchao_fp8 imports 06's tp)."""
    probe = (
        "import sys; before = list(sys.path); import tools.plan; "
        "from tools.chapters import chapter_module; "
        "fp8 = chapter_module('06-fp8', 'torchao_fp8'); "
        "assert sys.path == before, set(sys.path) ^ set(before); "
        "assert not {'published', 'tp', 'pipeline', 'experts', 'torchao_fp8'} & set(sys.modules); "
        "assert fp8.tp.__file__.endswith('06-fp8/tp.py'); "
        "assert chapter_module('06-fp8', 'torchao_fp8') is fp8"
    )
    command = [sys.executable, "-c", probe]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_deepseek_v3_671b_on_torchtitans_layout_by_hand(capsys, tmp_path):
    """DeepSeek-V3 (61 blocks, the first 3 dense; 58 layers of 256 experts of width 2,048, 8 per
    token, hidden 7,168) on 64 nodes of 8: pp 8 (stages of 8 blocks, the last three of 7), FSDP
    over each stage's 64 ranks, its experts over ep 32 x efsdp 2 (torchtitan's layout), full
    checkpointing, --batch-size 1: 8 rows of 4,096 tokens per dp rank, a micro-batch each. The
    second stage (8 blocks of experts, B parameters each, X of them experts', W the router's and
    shared expert's) is worked by hand: its GPU holds its 1/64 of the stage (16 bytes a parameter),
    gathers its 8 experts of each layer (8 / 256 of X) and the rest of each block, in bf16, all
    step, with their fp32 gradients whole (and a layer's experts' new gradient beside them, 4
    bytes each, at the peak); each micro-batch's 4,096 tokens go to their experts by all-to-all, 8
    copies of 7,168 bf16 values each, 31/32 to other ranks, dispatched and combined, in forward,
    backward and the recompute: per layer 2.54 GiB, 24 / 31 of it through the NIC (ep spans 4
    nodes of 8). Its experts' FSDP over efsdp 2: each layer's 8 experts gathered once and their
    gradients reduce-scattered. A block-FP8 release (the published config's quantization_config,
    left out of the shape) reads half the bf16 bytes."""
    import json
    import shutil

    from tools.plan import GIB, Layout, count, main, plan, published_io

    m = count(str(SHAPES / "deepseek-v3"))
    assert (m["params"], m["layers"], m["moe_layers"], m["experts"], m["top_k"]) == (671_026_404_352, 61, 58, 256, 8)
    b, x, w = m["block_sizes"][8], m["block_experts"][8], m["block_whole"][8]
    assert (b, x, w) == (11_507_286_016, 256 * 3 * 7168 * 2048, 256 * 7168 + 3 * 7168 * 2048)
    assert m["block_experts"][:4] == [0, 0, 0, x] and m["block_params"] == b > m["block_sizes"][0]
    layout = Layout("10", 512, checkpointing=True, pp=8, ep=32)
    planned = plan(m, layout, 1, 4096, 2, False)
    stage = planned["stages"][1]
    assert (stage["blocks"], stage["moe_layers"], stage["in_flight"]) == (8, 8, 7)
    assert stage["weights"] == 4 * 8 * b / 64 and stage["optimizer"] == 8 * 8 * b / 64
    gathered = 8 * (b - x + x / 32)
    assert stage["gathered"] == 2 * gathered
    assert stage["gradients"] == 4 * gathered + 4 * 8 * (b - x) / 64 + 4 * x / 32
    layer = 4096 * 8 * 7168 * 2 * 31 / 32 * 2 * 3
    assert stage["sent_ep"] == 8 * 8 * layer and stage["network_ep"] == stage["sent_ep"] * 24 / 31
    assert stage["sent_experts_fsdp"] == 1 / 2 * (2 + 4) * 8 * x / 32
    assert stage["sent_shard"] == 63 / 64 * (2 + 4) * 8 * (b - x)
    # The first stage holds 5 layers of experts, the last 7 and the head (and the loss).
    assert [s["moe_layers"] for s in planned["stages"]] == [5, 8, 8, 8, 8, 7, 7, 7]
    assert planned["total"] == max(s["total"] for s in planned["stages"])

    main([str(SHAPES / "deepseek-v3"), "--nodes", "64", "--pp-size", "8", "--ep-size", "32", "--batch-size", "1",
          "--seq-length", "4096", "--activation-checkpointing"])  # fmt: skip
    out = capsys.readouterr().out
    print(out)
    assert "chapter 10's mesh pp 8 x dp_replicate 1 x dp_shard 64 x cp 1 x tp 1" in out
    assert "Experts (10), mesh pp 8 x replicate 1 x efsdp 2 x ep 32 (ep innermost" in out
    assert f"x 3 (forward, backward, recompute): {layer / GIB:.3f} GiB" in out
    ep_row = f"ep (all-to-all)           32     1    4 nodes {5 * 8 * layer / GIB:12.2f}"
    assert ep_row in out and "efsdp (experts' FSDP)      2    32    2 nodes" in out
    assert f"their state (16 B)  {16 * 5 * x / 64 / GIB:18.2f}" in out

    # The release as published: block-FP8 (1 byte a weight of the blocks, a scale per 128 x 128).
    release = shutil.copytree(SHAPES / "deepseek-v3", tmp_path / "deepseek-v3")
    config = json.loads((release / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (release / "config.json").write_text(json.dumps(config))
    fp8 = count(str(release))
    bf16 = published_io(m, layout, planned)
    read = published_io(fp8, layout, plan(fp8, layout, 1, 4096, 2, False))
    assert 0.5 < read["read"] / bf16["read"] < 0.51 and read["written"] == bf16["written"]
    assert fp8["read_bytes"] == pytest.approx(673.15e9, rel=1e-4)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--pp-size", "2", "--ep-size", "3"], "--ep-size 3 must divide the 4 ranks that shard or split a stage's"),
        (["--nodes", "2", "--pp-size", "2", "--tp-size", "2", "--ep-size", "16"],
         "--ep-size 16 must divide the 8 ranks that shard or split a stage's weights"),
        (["--nodes", "4", "--pp-size", "2", "--ep-size", "16"], "--ep-size 16 must divide the model's 8 experts"),
        (["--nodes", "2", "--pp-size", "2", "--cp-size", "2", "--shard-size", "1", "--ep-size", "4"],
         "--ep-size 4 must divide the 2 ranks that shard or split"),
        (["--tp-size", "2", "--ep-size", "2"], "Chapter 10 runs EP with TP or CP too; this planner counts"),
    ],
    ids=["ep-3", "ep-past-the-stage", "ep-past-the-experts", "ep-past-hsdp", "tp-without-pp"],
)  # fmt: skip
def test_the_planner_refuses_the_experts_chapter_10_refuses(argv, words):
    """ep must divide the ranks of a stage that shard or split its weights, dp_shard x cp x tp
    (dims.check_sizes), and the experts of a layer (experts.check_model): tiny_moe's 8."""
    from tools.plan import main

    with pytest.raises(SystemExit) as exit:
        main([str(REPO / "common" / "tiny_moe"), "--batch-size", "2", *argv])
    assert str(exit.value.code).startswith("error: ") and words in str(exit.value.code)


def test_the_planner_refuses_tp_on_deepseek_v3_and_experts_on_a_dense_model():
    from tools.plan import main

    for model, argv, words in [
        (SHAPES / "deepseek-v3", ["--nodes", "8", "--pp-size", "2", "--tp-size", "8", "--ep-size", "4"],
         "--tp-size 8: chapter 05's plan is for Llama-style attention"),
        (REPO / "common" / "tiny_llama", ["--pp-size", "2", "--ep-size", "2", "--batch-size", "2"],
         "--ep-size 2: a dense model"),
    ]:  # fmt: skip
        with pytest.raises(SystemExit) as exit:
            main([str(model), *argv])
        assert words in str(exit.value.code)

import pytest
import torch
from harness import (
    FAST_ARGS,
    REPO,
    UNIFORM_LOSS,
    assert_released_late,
    assert_state_as_planned,
    compiled_graphs,
    last_lines,
    late_release,
    losses,
    read_metrics,
    rewind,
    run_chapter,
    run_forked,
)

from tools.plan import Layout

CHAPTER = "05-tensor-parallel"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "6"]
NUM_PARAMS = 918_656  # the tiny default model


def assert_matches(run, reference):
    """Losses, gradient norms and validation losses of `run` equal the reference's (fp32, ~1e-6)."""
    run, reference = read_metrics(run), read_metrics(reference)
    assert sorted(run) == list(range(1, STEPS + 1))
    for step in reference:
        assert abs(run[step]["loss"] - reference[step]["loss"]) <= 1e-5, step
        assert run[step]["grad_norm"] == pytest.approx(reference[step]["grad_norm"], rel=1e-4), step
    assert [run[6]["val_loss"], run[12]["val_loss"]] == pytest.approx(
        [reference[6]["val_loss"], reference[12]["val_loss"]], abs=1e-5
    )


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, hf_home):
    """Tensor parallel alone: one replica of 2 tp ranks, trained on the reference's global batch of 8 rows."""
    save_dir = tmp_path_factory.mktemp("tp")
    args = [*ARGS, "--tp-size", "2", "--batch-size", "8", "--save-dir", str(save_dir)]
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults=late_release(save_dir))
    return save_dir / CHAPTER


def test_the_run_exits_0_when_gloo_lets_go_of_a_tensor_late(tp_run):
    """The late release that once made a finished run abort at exit, made certain (harness.late_release):
    the chapter ends without the interpreter's shutdown, and the run exited 0."""
    assert_released_late(tp_run.parent)


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory, hf_home):
    """The 2-D mesh: 2 replicas (FSDP) of 2 tp ranks, 4 rows each per step."""
    save_dir = tmp_path_factory.mktemp("mesh")
    args = [*ARGS, "--tp-size", "2", "--save-dir", str(save_dir), "--export-hf", str(save_dir / "hf")]
    run_chapter(CHAPTER, *args, nproc=4, hf_home=hf_home, faults={"PROBE_STATE_BYTES": save_dir / "state.json"})
    return save_dir


def test_tensor_parallel_matches_ddp(ddp_reference, tp_run):
    # Split matmuls, sequence-parallel norms and the vocabulary-parallel loss compute chapter 02's numbers.
    assert_matches(tp_run, ddp_reference)


def test_2d_mesh_matches_ddp_and_shards_both_ways(ddp_reference, mesh_run):
    """Each replica trains on its own rows, its two tp ranks on the same ones: were the rows dealt
    by global rank instead of dp rank, the tp ranks would split rows that are not the same and the
    losses would not match."""
    assert_matches(mesh_run / CHAPTER, ddp_reference)
    # TP splits every weight in two and FSDP shards the halves in two: a quarter on each rank.
    metrics = read_metrics(mesh_run / CHAPTER)[STEPS]
    assert metrics["memory/params_gib"] * 2**30 == pytest.approx(NUM_PARAMS * 4 / 4, rel=0.05)
    assert metrics["memory/optimizer_gib"] * 2**30 == pytest.approx(2 * NUM_PARAMS * 4 / 4, rel=0.05)
    # As the planner (python -m tools.plan) predicts them, and the gradients' shards.
    assert_state_as_planned(mesh_run / "state.json", Layout("FSDP x TP", gpus=4, tp=2))


def test_resume_on_another_layout(tmp_path, hf_home, ddp_reference, mesh_run):
    """The 2 x 2 mesh's checkpoint at step 6, resumed with FSDP alone on 2 ranks: DCP reshards it
    into the new layout, and the job trains on as the uninterrupted run."""
    rewind(mesh_run / CHAPTER, tmp_path / CHAPTER, step=6)
    resumed = run_chapter(CHAPTER, *ARGS, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home)
    assert "step-00000006 at step 6" in resumed.stderr
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), losses(ddp_reference))) <= 1e-5


def test_exported_model_is_the_full_model(mesh_run):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(mesh_run / "hf")
    tokenizer = AutoTokenizer.from_pretrained(mesh_run / "hf")
    dcp_to_torch_save(mesh_run / CHAPTER / "checkpoints" / f"step-{STEPS:08d}", mesh_run / "full.pt")
    trained = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "common" / "tiny_llama"))
    trained.load_state_dict(torch.load(mesh_run / "full.pt")["model"])

    batch = tokenizer(["### Instruction:\nWhat is 12 + 30?\n\n### Response:\n42"], return_tensors="pt")
    with torch.no_grad():
        exported_loss = exported(**batch, labels=batch["input_ids"]).loss
        trained_loss = trained(**batch, labels=batch["input_ids"]).loss
    assert exported_loss == trained_loss
    assert exported_loss < UNIFORM_LOSS - 1


def test_compile_traces_every_block_with_no_recompiles(tmp_path, hf_home, tp_run):
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *ARGS, "--tp-size", "2", "--batch-size", "8", nproc=2)
    # Two graphs for training (step 1): the first block's input comes from the embedding, the others'
    # from a block's reduce-scatter, a tensor of another type (an async collective's result); two
    # more for evaluation (after step 6); never another, and no more for a deeper model.
    assert graphs == [2] * 6 + [4] * (STEPS - 6), graphs
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / CHAPTER), losses(tp_run))) <= 1e-5


def test_tied_embeddings_stay_tied(tmp_path, hf_home, tied_bf16_fsdp_reference):
    """Llama-3.2-1B ties its output layer to its embedding: both are split over the vocabulary, as
    one weight, and the model trains as chapter 04 trains it (tests/conftest.py's run: 2 ranks x 4
    rows, here one replica of 2 tp ranks on the same 8 rows per step)."""
    from harness import safetensors_in

    reference = tied_bf16_fsdp_reference
    args = [*FAST_ARGS, "--model-name", str(reference / "model"), "--max-steps", "3", "--batch-size", "8"]
    tp_args = [*args, "--tp-size", "2", "--save-dir", str(tmp_path), "--export-hf", str(tmp_path / "hf")]
    run_chapter(CHAPTER, *tp_args, nproc=2, hf_home=hf_home)
    tp_losses, fsdp_losses = losses(tmp_path / CHAPTER), losses(reference / "04-fsdp")
    assert len(tp_losses) == len(fsdp_losses) == 3
    assert max(abs(a - b) for a, b in zip(tp_losses, fsdp_losses)) <= 1e-5
    assert "lm_head.weight" not in safetensors_in(tmp_path / "hf"), "a tied output head is saved once"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp-size", "3"], "error: --tp-size 3 must divide the number of ranks (2)"),
        (["--tp-size", "2", "--seq-length", "127"], "error: --tp-size 2 must divide the model's --seq-length (127)"),
        (["--shard-size", "3"], "error: --shard-size 3 must divide the number of dp ranks (2)"),
    ],
    ids=["ranks", "seq-length", "shard-size"],
)
def test_layouts_that_cannot_split_are_refused(tmp_path, hf_home, args, message):
    proc = run_chapter(CHAPTER, *args, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert message in last_lines(proc.stderr), last_lines(proc.stderr)
    assert not (tmp_path / CHAPTER).exists()


def mlp_of_width_128(folder):
    """tiny_llama 96 wide, with 6 heads of 16 and 3 key/value heads (every width of attention divides
    by 3) and an MLP 128 wide, which 3 ranks cannot split."""
    import json
    import shutil

    shutil.copytree(REPO / "common" / "tiny_llama", folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 128}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("chapter", [CHAPTER, "10-nd-parallel"])
def test_a_width_tp_cannot_split_is_refused_in_one_line(chapter, tmp_path, hf_home):
    """The heads and the tokens divide by 3, the MLP's 128 does not: DTensor would fail deep in its
    matmuls' sharding propagation; the plan's check names the flag and the width, on every rank."""
    model = mlp_of_width_128(tmp_path / "model")
    flags = ["--tp-size", "3", "--seq-length", "126", "--model-name", str(model)]
    code, stderr, ends = run_forked(chapter, *flags, "--save-dir", str(tmp_path / "out"), nproc=3, hf_home=hf_home)
    message = "error: --tp-size 3 must divide the 128 outputs of mlp.gate_proj, which tensor parallel splits"
    assert code != 0 and message in last_lines(stderr, 2), ends
    assert "Traceback" not in stderr and not (tmp_path / "out" / chapter).exists(), ends

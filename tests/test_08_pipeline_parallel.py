"""Chapter 08: pipeline parallel on the CPU (gloo, fp32), against chapter 04 at the same global batch.

Runs are few and shared (each chapter process costs ~9 CPU-seconds, mostly imports): pp 2 with 1F1B on 2
ranks (compiled as on GPUs, exported), dp 2 x pp 2 interleaved on 4 ranks, and one chain of resumes
across layouts (chapter 04 itself resuming a pp 2 checkpoint, then pp 2 interleaved resuming chapter
04's, killed under torchrun --max-restarts). Chapter 04's reference is shared with its own tests
(conftest.py: 2 ranks x 4 rows, 8 rows per step, 12 steps). Refusals and the stages' cut are tested
in-process with the chapter's own functions, and one refusal under torchrun for its last line.
"""

import json

import pytest
import torch
from harness import FAST_ARGS, REPO, assert_released_late, differences, last_lines, late_release, losses, rewind
from harness import run_chapter
from model_families import config
from moe_families import tiny_config

CHAPTER = "08-pipeline-parallel"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS)]
SUPPORTED = ["llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "qwen2_moe"]  # and Gemma 3, untied


def assert_equal_to_04(run, reference, tmp_path):
    """Every step's loss, the validation losses and the final weights within 1e-5 of chapter 04's, and every
    step's gradient norm within 1e-5 of it, relatively (norms of 2 to 4, summed in another order: fp32 puts
    them ~3e-6 apart; a norm of each stage alone would be ~30% off, and clip each stage differently)."""
    worst = differences(run, reference, tmp_path)
    print(f"\nlargest differences to chapter 04 ({run.parent.name}): {worst}")
    assert max(worst.values()) <= 1e-5, worst


@pytest.fixture(scope="module")
def fsdp_run(fsdp_reference):
    """Chapter 04 on 2 ranks x 4 rows, 12 steps (conftest.py): the reference, 8 rows of 128 tokens per step."""
    return fsdp_reference / "04-fsdp"


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, hf_home):
    """pp 2 on 2 ranks, 1F1B: rank 0 the first stage (embeddings, 2 blocks), rank 1 the last (2 blocks, norm,
    head), each pipeline step 8 rows (--batch-size 4 for each of its 2 ranks) in 8 micro-batches of 1 row.
    Compiled as on GPUs (dynamo traces each block; the traced graphs run as they are), checkpointed every 3
    steps, exported at the end."""
    save_dir = tmp_path_factory.mktemp("pp")
    probe = save_dir / "compile_counts.jsonl"
    args = [*ARGS, "--pp-size", "2", "--compile", "--ckpt-freq", "3", "--keep-checkpoints", "4"]
    args += ["--save-dir", str(save_dir), "--export-hf", str(save_dir / "hf")]
    faults = {"PROBE_COMPILE_COUNTS": probe, "PROBE_COMPILE_BACKEND": "eager"}
    faults["PROBE_STATE_BYTES"] = save_dir / "state.json"
    proc = run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home, faults={**faults, **late_release(save_dir)})
    return save_dir, proc.stderr


def test_the_run_exits_0_when_gloo_lets_go_of_a_tensor_late(pp_run):
    """The late release that once made a finished run abort at exit, made certain (harness.late_release):
    the chapter ends without the interpreter's shutdown, and the run exited 0."""
    assert_released_late(pp_run[0])


def test_pp_2_with_1f1b_equals_fsdp_compiled_with_no_recompiles(pp_run, fsdp_run, tmp_path):
    save_dir, log = pp_run
    assert "459,264 parameters in stages [0] of 2, sharded over 1 ranks" in log
    assert "Straggler" not in log  # the stages hold as many blocks: neither waits on the other's compute
    assert_equal_to_04(save_dir / CHAPTER, fsdp_run, tmp_path)
    # Each block whole (no graph break), one graph for the blocks in training and one more for evaluation
    # (after step 6), none new later: as chapter 04.
    counts = [json.loads(line) for line in (save_dir / "compile_counts.jsonl").read_text().splitlines()]
    assert not any(count["graph_breaks"] for count in counts), counts
    assert [count["graphs"] for count in counts] == [1] * 6 + [2] * (STEPS - 6), counts


def test_the_export_holds_every_stage(pp_run, fsdp_reference):
    """Rank 0 holds the first stage only: it reads every stage's weights back from the end's checkpoint,
    and the folder loads with from_pretrained, as chapter 04's export does, with the same weights."""
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(pp_run[0] / "hf").state_dict()
    reference = AutoModelForCausalLM.from_pretrained(fsdp_reference / "hf").state_dict()
    assert exported.keys() == reference.keys()
    assert max((exported[name] - reference[name]).abs().max().item() for name in reference) <= 1e-5


def test_each_rank_holds_its_stage_as_planned(pp_run):
    """Rank 0's weights, its gradients (sharded, once the schedule's last backward has reduce-scattered them)
    and AdamW's moments are its stage's, as the planner counts them: the embeddings and 2 of 4 blocks."""
    from tools.plan import Layout, count, plan

    measured = json.loads((pp_run[0] / "state.json").read_text())
    predicted = plan(count(str(REPO / "common" / "tiny_llama")), Layout("PP", 2, pp=2), 4, 128, 4, fp8=False)
    assert measured["weights"] == pytest.approx(predicted["weights"], rel=0.01)
    assert measured["optimizer"] == pytest.approx(predicted["optimizer"], rel=0.01)
    assert measured["gradients"] == pytest.approx(predicted["sharded gradients"], rel=0.01)


def test_dp_2_x_pp_2_interleaved_equals_fsdp(tmp_path, hf_home, fsdp_run):
    """4 ranks: 2 pipelines of 2 ranks, each with 2 stages of 1 block (rank 0: stages 0 and 2, rank 1: 1 and 3),
    4 rows per pipeline step in 4 micro-batches; FSDP shards each stage over its 2 dp ranks."""
    args = [*ARGS, "--pp-size", "2", "--pp-schedule", "Interleaved1F1B", "--batch-size", "2"]
    proc = run_chapter(CHAPTER, *args, "--save-dir", str(tmp_path), nproc=4, hf_home=hf_home)
    assert "parameters in stages [0, 2] of 4, sharded over 2 ranks" in proc.stderr
    assert_equal_to_04(tmp_path / CHAPTER, fsdp_run, tmp_path)


def test_checkpoints_resume_across_pp_layouts_and_after_a_kill(tmp_path, hf_home, pp_run, fsdp_run):
    """pp 2's checkpoint of step 6 resumed by chapter 04 itself (2 ranks of 4 rows: the same 8 rows per step),
    whose checkpoint of step 9 is resumed at pp 2 again, interleaved (4 stages on 2 ranks), under torchrun
    --max-restarts: rank 1 is SIGKILLed in its 3rd optimizer step (step 11: loading AdamW's state takes one),
    after the checkpoint of step 10, and both restart from it. DCP reshards between the layouts: the
    names are chapter 04's, and the optimizer's groups name every stage's parameters. Every loss, the
    data position and the LR schedule with them, is the uninterrupted chapter 04's, and so are the weights."""
    reference = losses(fsdp_run)
    rewind(pp_run[0] / CHAPTER, tmp_path / "fsdp" / "04-fsdp", step=6)
    args = [*ARGS, "--ckpt-freq", "3", "--save-dir", str(tmp_path / "fsdp")]
    proc = run_chapter("04-fsdp", *args, nproc=2, hf_home=hf_home)
    assert "step-00000006 at step 6" in proc.stderr, proc.stderr[-3000:]
    assert max(abs(a - b) for a, b in zip(losses(tmp_path / "fsdp" / "04-fsdp"), reference)) <= 1e-5

    rewind(tmp_path / "fsdp" / "04-fsdp", tmp_path / "pp" / CHAPTER, step=9)
    args = [*ARGS, "--pp-size", "2", "--pp-schedule", "Interleaved1F1B", "--ckpt-freq", "5"]
    proc = run_chapter(
        CHAPTER, *args, "--save-dir", str(tmp_path / "pp"), nproc=2, hf_home=hf_home,
        torchrun_args=("--max-restarts", "1"), env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        faults={"FAULT_KILL_AT_STEP": 3, "FAULT_RANK": 1},
    )  # fmt: skip
    first, restarted, again = proc.stderr.partition("Workers restarted 1 time(s): resuming")
    assert restarted and "step-00000009 at step 9" in first, proc.stderr[-3000:]
    assert "step-00000010 at step 10" in again, again[-3000:]
    resumed = tmp_path / "pp" / CHAPTER
    worst = differences(resumed, fsdp_run, tmp_path)
    print(f"\nlargest differences to chapter 04 after the resumes and the kill: {worst}")
    assert len(losses(resumed)) == STEPS and max(worst.values()) <= 1e-5, worst


def test_a_bad_pp_size_is_refused_in_one_line_under_torchrun(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--pp-size", "2", "--save-dir", str(tmp_path), nproc=1, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "error: --pp-size 2 must divide the number of ranks (1)" in last_lines(proc.stderr), last_lines(proc.stderr)
    assert not (tmp_path / CHAPTER).exists()


def load_chapter():
    from tools.memory import load

    return load(CHAPTER)


@pytest.mark.parametrize(
    "argv, world_size, shard_size, message",
    [
        (["--pp-size", "3"], 4, 1, "--pp-size 3 must divide the number of ranks (4)"),
        (["--pp-size", "2", "--shard-size", "3"], 8, 3, "--shard-size 3 must divide the 4 ranks that hold each stage"),
        (["--pp-size", "2", "--pp-microbatches", "3"], 2, 1, "--pp-microbatches 3 must divide the 16 rows a pipeline"),
        (["--pp-size", "4", "--batch-size", "1", "--pp-microbatches", "2"], 4, 1,
         "--pp-microbatches 2: --pp-schedule 1F1B needs at least --pp-size (4) micro-batches"),
        (["--pp-size", "4", "--batch-size", "2", "--pp-schedule", "Interleaved1F1B", "--pp-microbatches", "2"], 4, 1,
         "--pp-microbatches 2: --pp-schedule Interleaved1F1B needs a multiple of --pp-size (4) micro-batches"),
    ],
    ids=["ranks", "shard-size", "microbatches-divide", "fewer-microbatches", "interleaved-multiple"],
)  # fmt: skip
def test_layouts_that_cannot_pipeline_are_refused(argv, world_size, shard_size, message):
    chapter = load_chapter()
    with pytest.raises(SystemExit) as refused:
        chapter.pipeline.check_layout(chapter.get_parser().parse_args(argv), world_size, shard_size)
    assert str(refused.value).startswith("error: ") and message in str(refused.value), refused.value
    # One row per micro-batch by default: as many as the pipeline's rows, at least its stages.
    chapter.pipeline.check_layout(chapter.get_parser().parse_args(["--pp-size", "4", "--batch-size", "1"]), 8, 2)


def meta_model(family, **changes):
    from transformers import AutoModelForCausalLM

    from common import transformer_blocks

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(family) if not changes else changed(family, **changes))
    return model, transformer_blocks(model)


def changed(family, **changes):
    model_config = config(family)
    for key, value in changes.items():
        setattr(model_config, key, value)
    return model_config


@pytest.mark.parametrize(
    "family, argv, message",
    [
        ("gpt2", ["--pp-size", "2"], "the stages are cut from Llama-style models (llama, mistral, "),
        ("gemma3_text", ["--pp-size", "2"], "Gemma3ForCausalLM ties its output layer to its input embeddings"),
        ("llama", ["--pp-size", "2", "--pp-schedule", "LoopedBFS"], "makes 4 stages, more than the model's 2 blocks"),
        ("qwen2_moe", ["--pp-size", "2"], "Qwen2MoeForCausalLM's config asks for the routers' balancing loss"),
    ],
    ids=["family", "tied", "blocks", "balancing-loss"],
)  # fmt: skip
def test_models_the_stages_cannot_be_cut_from_are_refused(family, argv, message):
    """In one line, before anything is cut (the tiny configs have 2 blocks); a MoE's config asking for the
    balancing loss, which the last stage would drop silently."""
    chapter = load_chapter()
    model, blocks = meta_model(family, **({"output_router_logits": True} if family == "qwen2_moe" else {}))
    with pytest.raises(SystemExit) as refused:
        chapter.pipeline.check_model(model, blocks, chapter.get_parser().parse_args(argv))
    assert str(refused.value).startswith(f"error: --pp-size 2") and message in str(refused.value), refused.value


MOE = {"qwen3_moe": {}, "deepseek_v3": {"first_k_dense_replace": 1}}


@pytest.mark.parametrize("family", [*SUPPORTED, *MOE, "gemma3_text"])
def test_the_stages_chained_compute_the_whole_model(family):
    """Each supported family's tiny model cut into 4 stages of 1 block (2 per rank, interleaved, on 2 ranks):
    the first stage from the token ids (embeddings, Gemma 3's scaled), the others from the hidden states,
    each with its own rotary position embeddings (Gemma 3's local and global ones) and masks (Mistral's,
    Gemma 3's sliding windows), the last through the final norm and the head; chained, they give the
    whole model's logits, to the last bit. Every stage holds the model's own modules, nothing of its own."""
    from transformers import AutoModelForCausalLM

    from common import transformer_blocks

    chapter = load_chapter()
    if family in MOE:  # tests/moe_families.py's (DeepSeek-V3's first block dense)
        model_config = tiny_config(family, num_hidden_layers=4, tie_word_embeddings=False, **MOE[family])
    else:
        model_config = changed(family, num_hidden_layers=4, tie_word_embeddings=False)
    if getattr(model_config, "layer_types", None):  # Gemma 3's, Qwen's: one per block
        model_config.layer_types = (model_config.layer_types * 4)[:4]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    ids = torch.randint(0, model_config.vocab_size, (2, 64))
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        blocks = transformer_blocks(model)
        chapter.pipeline.check_model(model, blocks, chapter.get_parser().parse_args(["--pp-size", "2"]))
        parts, _ = chapter.pipeline.split(model, blocks, [0, 1, 2, 3], 4)
        hidden = ids
        for stage, part in enumerate(parts):
            assert [i for i, layer in enumerate(part.model.layers) if layer is blocks[i]] == [stage]
            hidden = part(hidden)
    assert torch.equal(hidden, expected)


def test_a_rank_keeps_its_stages_modules_under_chapter_04s_names():
    """Rank 1 of pp 2, interleaved (stages 1 and 3 of 4, on a 4-block model): its model keeps blocks 1 and 3,
    the final norm and the head, under the names chapter 04's checkpoints use; the rest is cut away."""
    from transformers import AutoModelForCausalLM

    from common import transformer_blocks

    chapter = load_chapter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(changed("llama", num_hidden_layers=4))
    args = chapter.get_parser().parse_args(["--pp-size", "2", "--pp-schedule", "Interleaved1F1B"])
    num_stages, stages = chapter.pipeline.rank_stages(args, pp_rank=1)
    assert (num_stages, stages) == (4, [1, 3])
    parts, blocks = chapter.pipeline.split(model, transformer_blocks(model), stages, num_stages)
    names = {".".join(name.split(".")[:3]) if ".layers." in name else name for name, _ in model.named_parameters()}
    assert names == {"model.layers.1", "model.layers.3", "model.norm.weight", "lm_head.weight"}
    assert blocks == [model.model.layers[1], model.model.layers[3]] and len(parts) == 2
    assert parts[0].lm_head is None and parts[1].lm_head is model.lm_head and parts[0].model.embed_tokens is None

import json

import pytest
import torch
from harness import FAST_ARGS, compiled_graphs, last_lines, losses, rewind, run_chapter

CHAPTER = "06-fp8"
STEPS = 12
ARGS = [*FAST_ARGS, "--max-steps", str(STEPS), "--ckpt-freq", "6", "--fp8-emulate"]
# Every linear layer of the tiny default's 4 blocks computes in FP8: q, k, v, o, gate, up, down.
FP8_LAYERS = [f"model.layers.{i}.{name}" for i in range(4) for name in
              ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]]  # fmt: skip


def assert_trains_like_high_precision(run, reference):
    """FP8 rounds every matmul's inputs: the losses are not chapter 02's, but stay within 1% of them."""
    fp8, high = losses(run), losses(reference)
    assert len(fp8) == STEPS
    differences = [abs(a - b) / b for a, b in zip(fp8, high)]
    assert max(differences) > 1e-5, "the same losses as in high precision: nothing was computed in FP8"
    assert max(differences) < 0.01, differences
    assert fp8[-1] < fp8[0] - 1


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory, hf_home):
    """FSDP on 2 ranks, tensorwise scales (weights all-gathered in FP8), statistics every 4 steps."""
    save_dir = tmp_path_factory.mktemp("fp8")
    run_chapter(CHAPTER, *ARGS, "--fp8-stats-every", "4", "--save-dir", str(save_dir), nproc=2, hf_home=hf_home)
    return save_dir / CHAPTER


def test_fp8_trains_like_high_precision(ddp_reference, fp8_run):
    assert_trains_like_high_precision(fp8_run, ddp_reference)


def test_rowwise_scales_with_tensor_parallel(tmp_path, hf_home, ddp_reference):
    args = [*ARGS, "--fp8-recipe", "rowwise", "--tp-size", "2", "--batch-size", "8", "--save-dir", str(tmp_path)]
    run_chapter(CHAPTER, *args, nproc=2, hf_home=hf_home)
    assert_trains_like_high_precision(tmp_path / CHAPTER, ddp_reference)


def test_statistics_every_4_steps_for_every_fp8_layer(fp8_run):
    records = [json.loads(line) for line in (fp8_run / "metrics.jsonl").read_text().splitlines()]
    stats = [r for r in records if any(key.startswith("fp8/") for key in r)]
    assert [r["step"] for r in stats] == [4, 8, 12]
    expected = {
        f"fp8/{layer}/{tensor}_{stat}"
        for layer in FP8_LAYERS
        for tensor in ["input", "weight", "grad_output"]
        for stat in ["amax", "underflow", "saturated"]
    }
    for record in stats:
        assert set(record) - {"step"} == expected
        for key, value in record.items():
            if key.endswith("_amax"):
                assert value > 0, key
            elif key.endswith("_saturated"):
                assert value == 0, key  # dynamic scaling maps each amax onto FP8's largest value
            elif key.endswith("_underflow"):
                assert 0 <= value < 0.05, key


def test_statistics_count_what_underflows():
    """One FP8 layer, one input: amax 448 maps onto e4m3's largest value with a scale of 1, so 1e-4
    (below e4m3's smallest subnormal, 2**-9) becomes 0, and 0.01 does not. A quarter of the values
    underflow; the exact zero is not counted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from common.fp8 import Float8Stats

    model = convert_to_float8_training(
        torch.nn.Sequential(torch.nn.Linear(16, 16)), config=Float8LinearConfig(emulate=True)
    )
    stats = Float8Stats(model, group=None, reduce=False)
    x = torch.tensor([448.0, 1e-4, 0.01, 0.0] * 4).repeat(2, 1)
    stats.start()
    model(x).sum().backward()
    metrics = stats.stop()
    assert metrics["fp8/0/input_amax"] == 448.0
    assert metrics["fp8/0/input_underflow"] == 0.25
    assert metrics["fp8/0/input_saturated"] == 0.0
    assert metrics["fp8/0/grad_output_amax"] == 1.0  # d(sum)/d(output)


def test_exact_resume(tmp_path, hf_home, fp8_run):
    """FP8's scales are computed from the weights and activations of each step: nothing to save, and
    a run resumed from step 6 retraces the uninterrupted one exactly."""
    rewind(fp8_run, tmp_path / CHAPTER, step=6)
    resumed = run_chapter(CHAPTER, *ARGS, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home)
    assert "step-00000006 at step 6" in resumed.stderr
    assert losses(tmp_path / CHAPTER) == losses(fp8_run)


def test_compile_traces_once_and_statistics_steps_run_eagerly(tmp_path, hf_home, fp8_run):
    graphs = compiled_graphs(CHAPTER, tmp_path, hf_home, *ARGS, "--fp8-stats-every", "4", nproc=2)
    # Steps 4, 8 and 12 collect statistics with hooks, outside compiled code: no graph for them.
    assert graphs == [1] * 6 + [2] * (STEPS - 6), graphs
    assert losses(tmp_path / CHAPTER) == pytest.approx(losses(fp8_run), abs=1e-5)


def test_without_fp8_hardware_it_asks_for_emulation(tmp_path, hf_home):
    proc = run_chapter(CHAPTER, "--save-dir", str(tmp_path), nproc=1, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "error: this cpu has no FP8 matmuls" in last_lines(proc.stderr)
    assert "pass --fp8-emulate" in last_lines(proc.stderr)
    assert not (tmp_path / CHAPTER).exists()

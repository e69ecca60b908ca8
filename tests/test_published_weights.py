"""Published weights in and out (chapters 04-09): `--from-pretrained` reads each rank's own slices of
the safetensors after the model is parallelized, `--export-hf` writes each rank's own and merges them
on every rank. No rank holds the whole model.

The sources are seeded tiny Llamas saved in bf16 in several files, as the Hub publishes: untied with a
vocabulary of 515 (no layout divides it evenly), tied, and a block-FP8 one (DeepSeek-V3's format). Each
layout starts from one and runs one step, whose learning rate is 0 (the warmup's first): its loss and
gradient norm are chapter 01's (whose start is transformers' own from_pretrained), and its export holds
the source's names, shapes, dtypes and values bit for bit. What each rank's memory holds during a start
and an export is measured on a 61M-parameter model (tests/published_weights.py).
"""

import json
import shutil
import sys

import pytest
import torch
from harness import FAST_ARGS, REPO, chapter_env, last_lines, rank_servers, read_metrics, run_chapter
from harness import run_forked, safetensors_in
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

TINY = REPO / "common" / "tiny_llama"
ARGS = [*FAST_ARGS, "--max-steps", "1", "--eval-every", "100"]  # warmup 5: the one step's lr is 0
MIB = 2**20
MARGIN = 48 * MIB  # the allocator's and the process group's own, above a rank's shard and one tensor


def save_seeded(config, folder, max_shard_size="400KB"):
    """`config`'s model, seeded weights in bf16 in files of at most `max_shard_size`, with the tiny
    default's tokenizer: a folder as the Hub publishes one."""
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder, max_shard_size=max_shard_size)
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(TINY / name, folder / name)
    return folder


def save_source(folder, tied=False, vocab=515, layers=4):
    """The tiny Llama's shape, tied or not, at a vocabulary TP splits unevenly (515) or evenly."""
    config = AutoConfig.from_pretrained(TINY)
    config.vocab_size, config.tie_word_embeddings, config.num_hidden_layers = vocab, tied, layers
    return save_seeded(config, folder)


def save_moe_source(folder):
    """The tiny Qwen3-MoE (8 experts per block, no balancing loss asked for: chapter 09 runs with
    --aux-loss-coef 0, the same objective as the others), each expert's own tensors, as
    save_pretrained publishes them."""
    return save_seeded(AutoConfig.from_pretrained(REPO / "common" / "tiny_moe"), folder)


def save_gemma3_source(folder):
    """A tiny Gemma 3 (tests/model_families.py's): its embedding's scale, a buffer no file holds,
    which TP makes a DTensor; in two files."""
    from model_families import config

    return save_seeded(config("gemma3_text"), folder, max_shard_size="200KB")


def save_deepseek_source(folder):
    """A tiny DeepSeek-V3 (tests/moe_families.py's) of 4 blocks, the first dense, as save_pretrained
    publishes it: each expert's own tensors (`mlp.experts.3.up_proj.weight`)."""
    from moe_families import tiny_config

    return save_seeded(tiny_config("deepseek_v3", num_hidden_layers=4, first_k_dense_replace=1), folder)


def quantize_blocks(weight, block=128):
    """DeepSeek-V3's FP8: e4m3 values, one fp32 scale per 128 x 128 block (`weight_scale_inv`)."""
    rows, cols = weight.shape
    padded = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    padded[:rows, :cols] = weight.float()
    tiles = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # (R, block, C, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
    quantized = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return quantized.flatten(2).flatten(0, 1)[:rows, :cols].contiguous(), scale


def dequantize_blocks(quantized, scale, block=128):
    expanded = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return quantized.float() * expanded[: quantized.shape[0], : quantized.shape[1]]


def save_fp8_source(folder, source):
    """`source` with every block's linear weights in block FP8, in two files, its config saying so."""
    folder.mkdir()
    weights, files = safetensors_in(source), [{}, {}]
    for i, (name, value) in enumerate(sorted(weights.items())):
        if ".layers." in name and value.ndim == 2:
            value, files[i % 2][name + "_scale_inv"] = quantize_blocks(value)
        files[i % 2][name] = value
    weight_map = {}
    for i, file in enumerate(files, start=1):
        save_file(file, folder / f"model-0000{i}-of-00002.safetensors", metadata={"format": "pt"})
        weight_map |= {name: f"model-0000{i}-of-00002.safetensors" for name in file}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    for name in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(source / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sources")
    untied = save_source(folder / "untied")
    return {"untied": untied, "tied": save_source(folder / "tied", tied=True, vocab=512),
            "fp8": save_fp8_source(folder / "fp8", untied), "moe": save_moe_source(folder / "moe"),
            "gemma3": save_gemma3_source(folder / "gemma3"),
            "deepseek_fp8": save_fp8_source(folder / "deepseek_fp8", save_deepseek_source(folder / "deepseek"))}  # fmt: skip


@pytest.fixture(scope="module")
def references(sources, tmp_path_factory, hf_home):
    """Chapter 01's first step (8 rows) from each source through transformers' from_pretrained."""
    out = tmp_path_factory.mktemp("references")
    steps = {}
    for name in ["untied", "tied", "moe", "gemma3"]:
        args = [*ARGS, "--batch-size", "8", "--model-name", str(sources[name]), "--from-pretrained"]
        run_chapter("01-single-gpu", *args, "--save-dir", str(out / name), hf_home=hf_home)
        steps[name] = read_metrics(out / name / "01-single-gpu")[1]
    return steps


# Files of at most 300 kB (EXPORT_FILE_BYTES): the tiny models' exports in 5 to 7 files, merged on
# each of 2 or 4 ranks (file i by rank i), as a large model's are on a cluster.
SEVERAL_FILES = {"EXPORT_FILE_BYTES": "300000"}
LAYOUTS = {  # chapter, ranks, source, flags: 8 rows in each step
    "04-hsdp-tied": ("04-fsdp", 4, "tied", ["--shard-size", "2", "--batch-size", "2"]),
    "05-fsdp-x-tp": ("05-tensor-parallel", 4, "untied", ["--tp-size", "2", "--batch-size", "4"]),
    "05-gemma3-tp": ("05-tensor-parallel", 2, "gemma3", ["--tp-size", "2", "--batch-size", "8"]),
    "06-fp8-x-tp": ("06-fp8", 2, "untied", ["--tp-size", "2", "--fp8-emulate", "--batch-size", "8"]),
    "07-cp": ("07-context-parallel", 2, "untied", ["--cp-size", "2", "--batch-size", "8"]),
    "08-pp-x-fsdp": ("08-pipeline-parallel", 4, "untied", ["--pp-size", "2", "--batch-size", "2"]),
    "04-moe": ("04-fsdp", 2, "moe", ["--batch-size", "4"]),  # whole experts on each rank, by name
    "09-ep": ("09-expert-parallel", 2, "moe", ["--ep-size", "2", "--aux-loss-coef", "0", "--batch-size", "4"]),
    "09-ep-x-efsdp": ("09-expert-parallel", 4, "moe", ["--ep-size", "2", "--aux-loss-coef", "0", "--batch-size", "2"]),
    # Each rank its stage's slices of its tp half: a pipeline of 2 x 4 rows.
    "10-pp-x-tp": ("10-nd-parallel", 4, "untied", ["--pp-size", "2", "--tp-size", "2", "--batch-size", "4"]),
    # Each rank its stage's experts, half of them: a pipeline of 2 x 2 rows.
    "10-pp-x-ep": ("10-nd-parallel", 4, "moe", ["--pp-size", "2", "--ep-size", "2", "--batch-size", "2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_starts_as_from_pretrained_and_exports_the_source(layout, sources, references, tmp_path,
                                                                      hf_home):  # fmt: skip
    """The step from the sliced start is chapter 01's (whose start is from_pretrained), loss and gradient
    norm within 1e-5; the export after it (learning rate 0) is the source, bit for bit. Chapter 06's
    FP8 matmuls round: its loss and norm are chapter 01's within 2%, and its export is the source."""
    chapter, ranks, source, flags = LAYOUTS[layout]
    args = [*ARGS, *flags, "--model-name", str(sources[source]), "--from-pretrained"]
    several = layout in ("04-hsdp-tied", "07-cp", "08-pp-x-fsdp", "09-ep-x-efsdp", "10-pp-x-tp", "10-pp-x-ep")
    run_chapter(chapter, *args, "--save-dir", str(tmp_path), "--export-hf", str(tmp_path / "hf"), nproc=ranks,
                hf_home=hf_home, env=SEVERAL_FILES if several else None)  # fmt: skip
    step, reference = read_metrics(tmp_path / chapter)[1], references[source]
    tolerance = 2e-2 if chapter == "06-fp8" else 1e-5  # fp32 sums in another order; FP8's rounding
    assert abs(step["loss"] - reference["loss"]) <= tolerance, (step["loss"], reference["loss"])
    assert abs(step["grad_norm"] - reference["grad_norm"]) <= tolerance * reference["grad_norm"], step
    exported, published = safetensors_in(tmp_path / "hf"), safetensors_in(sources[source])
    assert exported.keys() == published.keys()
    for name, value in published.items():
        assert exported[name].dtype == value.dtype and torch.equal(exported[name], value), name
    assert AutoConfig.from_pretrained(tmp_path / "hf").architectures == AutoConfig.from_pretrained(
        sources[source]).architectures  # fmt: skip
    assert not list(tmp_path.glob("hf.*")), "a staging folder left behind"
    assert_indexed_as_save_pretrained_does(tmp_path / "hf", sources[source], several)


def assert_indexed_as_save_pretrained_does(export, source, several):
    """Several files: an index as save_pretrained writes it (sorted names, each file holding exactly
    the names it maps to it, the same total parameters and bytes as save_pretrained's of the same
    model); one file: model.safetensors, no index, as save_pretrained writes it."""
    files = sorted(path.name for path in export.glob("*.safetensors"))
    if not several:
        assert files == ["model.safetensors"] and not (export / "model.safetensors.index.json").exists()
        return
    from safetensors import safe_open

    index = json.loads((export / "model.safetensors.index.json").read_text())
    count = len(files)
    assert count >= 4 and files == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    for file in files:
        with safe_open(export / file, framework="pt") as tensors:
            assert set(tensors.keys()) == {n for n, f in index["weight_map"].items() if f == file}, file
    saved = export.parent / "save_pretrained"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(saved, max_shard_size="300KB")
    assert index["metadata"] == json.loads((saved / "model.safetensors.index.json").read_text())["metadata"]


def test_every_sharded_chapter_reads_and_writes_through_one_published_py():
    """No rank holds the whole model from chapter 04 on, and each chapter imports the one module that
    reads and writes published weights by each rank's slices (common/published.py): a fix is made
    once, and no chapter keeps a copy of its own."""
    for chapter in ["04-fsdp", "05-tensor-parallel", "06-fp8", "07-context-parallel", "08-pipeline-parallel",
                    "09-expert-parallel", "10-nd-parallel"]:  # fmt: skip
        assert "\nfrom common import published  #" in (REPO / chapter / "train_llm.py").read_text(), chapter
        assert not (REPO / chapter / "published.py").exists(), chapter


def test_block_fp8_weights_are_dequantized_as_each_rank_reads_them(sources, tmp_path, hf_home):
    """DeepSeek-V3's format: each rank's slices dequantized by DCP's quantized reader, its 128 x 128
    blocks' scales applied; exported in fp32, the weights are the dequantized ones, with no scales and
    no quantization_config left."""
    args = [*ARGS, "--batch-size", "4", "--model-name", str(sources["fp8"]), "--from-pretrained"]
    run_chapter("04-fsdp", *args, "--save-dir", str(tmp_path), "--export-hf", str(tmp_path / "hf"),
                "--export-dtype", "float32", nproc=2, hf_home=hf_home)  # fmt: skip
    published, exported = safetensors_in(sources["fp8"]), safetensors_in(tmp_path / "hf")
    assert exported.keys() == {name for name in published if not name.endswith("_scale_inv")}
    for name, value in exported.items():
        scale = published.get(name + "_scale_inv")
        expected = published[name].float() if scale is None else dequantize_blocks(published[name], scale)
        assert torch.equal(value, expected), name
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())


def test_deepseek_v3_starts_from_its_block_fp8_release_at_pp_2_x_ep_2_and_exports_it(sources, tmp_path, hf_home):
    """DeepSeek-V3's release as it is published (per-expert tensors in block FP8, their scales beside
    them), started at pp 2 x ep 2 (chapter 10): each rank dequantizes only its stage's slices, of its
    experts; the export (bf16, the config's) holds the release's names without the scales, each tensor
    the dequantized one in bf16, and loads with from_pretrained. Routing biases held still (rate 0)."""
    flags = ["--pp-size", "2", "--ep-size", "2", "--batch-size", "2", "--bias-update-rate", "0"]
    args = [*ARGS, *flags, "--model-name", str(sources["deepseek_fp8"]), "--from-pretrained"]
    run_chapter("10-nd-parallel", *args, "--save-dir", str(tmp_path), "--export-hf", str(tmp_path / "hf"), nproc=4,
                hf_home=hf_home, env=SEVERAL_FILES)  # fmt: skip
    published, exported = safetensors_in(sources["deepseek_fp8"]), safetensors_in(tmp_path / "hf")
    assert exported.keys() == {name for name in published if not name.endswith("_scale_inv")}
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in exported
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and model.dtype == torch.bfloat16
    # bf16, but for the routers' weights and biases, which HF keeps in fp32 (the experts: stacked there)
    dtypes = {name: value.dtype for name, value in model.state_dict().items()}
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
    for name, value in exported.items():
        scale = published.get(name + "_scale_inv")
        expected = published[name].float() if scale is None else dequantize_blocks(published[name], scale)
        assert value.dtype == dtypes.get(name, torch.bfloat16), name
        assert torch.equal(value, expected.to(value.dtype)), name


@pytest.mark.parametrize("ranks, family", [(2, "llama"), (4, "llama-tied")])
def test_each_rank_holds_only_its_shard_and_one_tensor(ranks, family, tmp_path_factory, hf_home):
    """61M parameters (244 MB in fp32, its largest tensor 62.5 MiB): during the start and during the
    export, each rank's anonymous memory grows by at most its own shard, the largest tensor and
    MARGIN; before, rank 0 held the whole model (334 MiB at 2 ranks, 279 at 4: BENCHMARKS.md). Its
    weights equal from_pretrained's, and the export is the source."""
    folder = tmp_path_factory.getbasetemp() / "published_weights"
    folder.mkdir(exist_ok=True)
    script = str(REPO / "tests" / "published_weights.py")
    code, stdout, stderr, ends = rank_servers.run(script, [str(folder), "--family", family], ranks,
                                                  chapter_env(hf_home), 600, "published_weights.py")  # fmt: skip
    assert code == 0, ends or stderr[-3000:]
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["export_equals_source"]
    for rank, measured in enumerate(result["ranks"]):
        bound = measured["shard"] + measured["largest"] + MARGIN
        assert measured["equal"], rank
        assert measured["start_peak"] <= bound, (rank, measured)
        assert measured["export_peak"] <= bound, (rank, measured)


def test_a_model_without_safetensors_is_refused_in_one_line_under_torchrun(sources, tmp_path, hf_home):
    folder = tmp_path / "bin_only"
    shutil.copytree(sources["untied"], folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    torch.save({}, folder / "pytorch_model.bin")
    args = [*ARGS, "--model-name", str(folder), "--from-pretrained", "--save-dir", str(tmp_path)]
    proc = run_chapter("04-fsdp", *args, nproc=2, hf_home=hf_home, check=False)
    assert proc.returncode != 0
    assert "has no .safetensors files (published as .bin only?)" in last_lines(proc.stderr), proc.stderr[-3000:]
    assert not (tmp_path / "04-fsdp").exists()


def test_a_folder_without_a_tensor_of_the_model_is_refused(sources, tmp_path, hf_home):
    """A config of 5 blocks over files of 4: the first missing tensor named, before any step."""
    folder = tmp_path / "five_blocks"
    shutil.copytree(sources["untied"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5}))
    args = [*ARGS, "--model-name", str(folder), "--from-pretrained", "--save-dir", str(tmp_path)]
    code, stderr, ends = run_forked("04-fsdp", *args, nproc=2, hf_home=hf_home)
    assert code != 0
    assert f"error: --from-pretrained: {folder} does not hold this model's weights (" in stderr, ends
    assert "model.layers.4." in stderr and "Traceback" not in stderr, ends
    assert not (tmp_path / "04-fsdp" / "metrics.jsonl").exists()


def test_an_export_folder_that_holds_other_files_or_is_not_shared_is_refused_before_training(
    sources, tmp_path, hf_home
):
    """Before any step, one line naming the folder: a folder of other files, another model (its
    config and safetensors, no export's manifest), an earlier export with a note beside it, or the
    folder --model-name reads, is never replaced; nothing in it is touched. Ranks that see different
    folders (nodes with their own disks) cannot merge each other's shards."""
    args = [*ARGS, "--model-name", str(sources["untied"]), "--save-dir", str(tmp_path)]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    other_model = shutil.copytree(sources["tied"], tmp_path / "other_model")
    before = {path: path.read_bytes() for path in [*other_model.iterdir(), tmp_path / "mine" / "notes.txt"]}
    for folder, files in [(tmp_path / "mine", "notes.txt"), (other_model, "config.json, generation_config.json")]:
        code, stderr, ends = run_forked("04-fsdp", *args, "--export-hf", str(folder), nproc=2, hf_home=hf_home)
        assert code != 0 and f"error: --export-hf {folder}: {folder} holds files no export wrote ({files}" in stderr, ends
    code, stderr, ends = run_forked("04-fsdp", *args, "--export-hf", str(sources["untied"]), nproc=2,
                                    hf_home=hf_home)  # fmt: skip
    assert code != 0 and "is the folder --model-name reads, which an export would replace" in stderr, ends
    assert {path: path.read_bytes() for path in before} == before
    nodes = [["--export-hf", str(tmp_path / "node0" / "hf")], ["--export-hf", str(tmp_path / "node1" / "hf")]]
    (tmp_path / "node0").mkdir(), (tmp_path / "node1").mkdir()
    code, stderr, ends = run_forked("04-fsdp", *args, nproc=2, hf_home=hf_home, rank_args=nodes)
    assert code != 0, ends
    assert "does not see rank 0's files there: pass a folder shared by all nodes" in stderr, ends
    assert not (tmp_path / "04-fsdp" / "metrics.jsonl").exists()


def test_an_export_replaces_an_earlier_one_and_a_kill_meanwhile_leaves_one_in_place(sources, tmp_path, hf_home):
    """An export (bf16) replaced by the same job's export in fp32, killed at each step of the
    replacing (rank 0, published.replace_export): before the folders are swapped, the earlier export
    is in place; after, the new one; never neither. Where the file system cannot swap (NFS), a kill
    between its two renames leaves the earlier export beside the folder (.old), and the next run puts
    it back before exporting again. A note added beside an export makes it another's: refused."""
    hf = tmp_path / "hf"
    args = [*ARGS, "--model-name", str(sources["untied"]), "--from-pretrained", "--save-dir", str(tmp_path)]
    args += ["--export-hf", str(hf)]

    def export(dtype, faults=None):  # the run resumes at its last step: the export alone
        return run_forked("04-fsdp", *args, "--export-dtype", dtype, nproc=2, hf_home=hf_home, faults=faults)

    def exported_dtype(folder):
        return {value.dtype for value in safetensors_in(folder).values()}

    assert export("bfloat16")[0] == 0 and exported_dtype(hf) == {torch.bfloat16}
    code, _, ends = export("float32", {"FAULT_KILL_DURING_EXPORT_PUBLISH": 1})  # before the swap
    assert code != 0 and "SIGKILL" in ends.split("\n")[0], ends
    assert exported_dtype(hf) == {torch.bfloat16} and AutoModelForCausalLM.from_pretrained(hf)
    code, _, ends = export("float32", {"FAULT_KILL_DURING_EXPORT_PUBLISH": 2})  # swapped, not removed
    assert code != 0 and exported_dtype(hf) == {torch.float32}, ends
    assert exported_dtype(tmp_path / "hf.tmp") == {torch.bfloat16}  # the earlier one, removed next time
    code, _, ends = export("bfloat16", {"FAULT_KILL_DURING_EXPORT_PUBLISH": 2, "FAULT_NO_RENAME_EXCHANGE": 1})
    assert code != 0 and not hf.exists() and exported_dtype(tmp_path / "hf.old") == {torch.float32}, ends
    assert export("bfloat16")[0] == 0 and exported_dtype(hf) == {torch.bfloat16}
    assert sorted(path.name for path in tmp_path.glob("hf*")) == ["hf"]
    assert safetensors_in(hf).keys() == safetensors_in(sources["untied"]).keys()
    (hf / "notes.txt").write_text("my notes")
    code, stderr, ends = export("bfloat16")
    assert code != 0 and f"error: --export-hf {hf}: {hf} holds files no export wrote (notes.txt)" in stderr, ends
    assert (hf / "notes.txt").read_text() == "my notes"


def test_a_rank_killed_during_the_export_leaves_nothing_that_looks_complete(sources, tmp_path, hf_home):
    """Rank 1 dies after merging its file: the export folder is not there, its staging folder has no
    index of the files (from_pretrained refuses it), and a rerun exports it whole."""
    args = [*ARGS, "--model-name", str(sources["untied"]), "--from-pretrained", "--save-dir", str(tmp_path)]
    args += ["--export-hf", str(tmp_path / "hf")]
    code, _, ends = run_forked("04-fsdp", *args, nproc=2, hf_home=hf_home,
                               faults={"FAULT_KILL_DURING_EXPORT": 1, "FAULT_RANK": 1})  # fmt: skip
    assert code != 0 and "rank 1 (local_rank 1" in ends.split("\n")[0] and "SIGKILL" in ends.split("\n")[0], ends
    assert not (tmp_path / "hf").exists()
    assert list((tmp_path / "hf.tmp").glob("*.safetensors")), "rank 1 had merged its file"
    assert not (tmp_path / "hf.tmp" / "model.safetensors.index.json").exists()  # rank 0 writes it last
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(tmp_path / "hf.tmp")
    run_chapter("04-fsdp", *args, nproc=2, hf_home=hf_home)  # resumes at the last step: the export alone
    assert safetensors_in(tmp_path / "hf").keys() == safetensors_in(sources["untied"]).keys()
    assert not (tmp_path / "hf.tmp").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB file system: room for the ranks' shards of the tiny model in bf16 (1.8 MiB), not for
    them and the merged files."""
    from harness import small_disk

    with small_disk(tmp_path / "small_disk", "3m") as mount:
        yield mount


def test_a_full_disk_during_the_merge_is_one_line_and_publishes_nothing(sources, small_disk, tmp_path, hf_home):
    args = [*ARGS, "--model-name", str(sources["untied"]), "--save-dir", str(tmp_path)]
    code, stderr, ends = run_forked("04-fsdp", *args, "--export-hf", str(small_disk / "hf"), nproc=2,
                                    hf_home=hf_home)  # fmt: skip
    assert code != 0
    assert f"error: no space left on the device of {small_disk} while exporting --export-hf" in stderr, ends
    assert "nothing was published and the checkpoints are intact" in stderr
    # Only a staging folder may remain (a rank still writing as another cleaned up): the next export
    # removes it first.
    assert [path.name for path in small_disk.iterdir()] in ([], ["hf.tmp"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from harness import REPO

from common import DEFAULT_MODEL, latest_checkpoint, load_and_pack, publish_checkpoint
from tools.diff import chapters


def test_packing_keeps_every_token_in_order(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    docs = [f"document {i}: " + "word " * (i % 7) for i in range(50)]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)

    packed, no_validation = load_and_pack(str(tmp_path / "data"), tokenizer, seq_length=16, val_fraction=0.0)
    assert no_validation is None

    stream = [t for d in docs for t in tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]]
    rows = packed[:]  # a dict of (rows, 16) tensors
    assert len(packed) == len(stream) // 16
    assert rows["input_ids"].shape == (len(packed), 16)
    assert rows["input_ids"].flatten().tolist() == stream[: len(packed) * 16]
    assert rows["labels"].equal(rows["input_ids"])  # the model shifts labels itself


def test_a_small_dataset_is_packed_in_this_process(tmp_path, monkeypatch):
    """No process pool under 50,000 documents: datasets runs num_proc=1 in a forked pool of one (and a
    manager process), which every rank of every run paid for, and which, forked from a process with
    threads, can deadlock and be waited on forever (a test of this suite did, in CI)."""
    import multiprocess.pool
    from transformers import AutoTokenizer

    def no_pool(*args, **kwargs):
        raise AssertionError("load_and_pack started a process pool")

    monkeypatch.setattr(multiprocess.pool.Pool, "__init__", no_pool)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(99)))
    train, val = load_and_pack(str(tmp_path / "data"), AutoTokenizer.from_pretrained(DEFAULT_MODEL), 16, 0.1)
    assert len(train) > 0 and len(val) > 0


def test_packed_rows_take_4_bytes_per_token_on_disk(tmp_path, monkeypatch):
    """The cache holds one column of int32 rows of fixed length and nothing else (no labels, no
    tokenized documents): 4 bytes per token, plus the Arrow file's header. It was 12, with the
    tokenized documents on top. The rows come out as int64, with the labels made as they are read."""
    import datasets
    from transformers import AutoTokenizer

    from common import DEFAULT_DATASET

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    train, val = load_and_pack(DEFAULT_DATASET, tokenizer, seq_length=128, val_fraction=0.01)
    assert train.features == datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"), length=128)})
    [packed_file] = {f["filename"] for f in train.cache_files}
    tokens = (len(train) + len(val)) * 128
    assert 4 <= os.path.getsize(packed_file) / tokens < 4.01
    written = [p for p in tmp_path.rglob("*.arrow") if "cache-" in p.name]
    assert [str(p) for p in written] == [packed_file]  # the one map that tokenizes and packs
    row = train[0]
    assert row["input_ids"].dtype == torch.int64 and row["labels"].equal(row["input_ids"])


def test_validation_rows_are_held_out_of_training(tmp_path, monkeypatch):
    """Without a validation split, the last --val-fraction of the packed rows: training never sees them."""
    from transformers import AutoTokenizer

    from common import DEFAULT_DATASET

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    tokenizer = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    everything, _ = load_and_pack(DEFAULT_DATASET, tokenizer, seq_length=128, val_fraction=0.0)
    train, val = load_and_pack(DEFAULT_DATASET, tokenizer, seq_length=128, val_fraction=0.01)
    assert len(val) == -(-len(everything) // 100) and len(train) + len(val) == len(everything)
    assert train[:]["input_ids"].equal(everything[: len(train)]["input_ids"])
    assert val[:]["input_ids"].equal(everything[len(train) :]["input_ids"])
    # A dataset's own validation split is used as it is, and the training split kept whole.
    (tmp_path / "data").mkdir()
    for split, count in [("train", 300), ("validation", 40)]:
        rows = [json.dumps({"text": f"{split} document {i}: " + "word " * (i % 9)}) for i in range(count)]
        (tmp_path / "data" / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    train, val = load_and_pack(str(tmp_path / "data"), tokenizer, seq_length=16, val_fraction=0.5)
    assert len(val) < len(train) and tokenizer.decode(val[0]["input_ids"]).startswith("<s>validation document 0")


def test_checkpoint_folders(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    assert latest_checkpoint(tmp_path) is None
    for name in ["step-00000004", "step-00000010", "step-00000012.tmp"]:
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "state.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "step-00000010", "an unfinished save is never resumed from"

    staged = checkpoints / "step-00000014.tmp"
    staged.mkdir()
    (staged / "state.json").write_text('{"global_step": 14}')
    publish_checkpoint(staged, checkpoints / "step-00000014", keep=2)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000010", "step-00000014"]
    assert (latest_checkpoint(tmp_path) / "state.json").read_text() == '{"global_step": 14}'


def test_each_chapter_runs_in_its_own_folder_by_default():
    # Following the chapters in order must not make chapter N resume chapter N-1's run.
    from tools.memory import load  # puts the chapter's folder on sys.path, as running its script does

    for chapter in chapters():
        module = load(chapter.name)
        assert module.get_parser().parse_args([]).experiment_name == chapter.name


FORK_PROBE = """
import os, runpy, sys
sys.argv = ["train_llm.py"]
try:
    runpy.run_path("train_llm.py", run_name="__main__")
except SystemExit as stop:
    print(stop, file=sys.stderr)
repo = os.environ["REPO"]
print(*[m.__file__ for m in list(sys.modules.values()) if (getattr(m, "__file__", None) or "").startswith(repo)])
"""


@pytest.mark.parametrize(
    "chapter", ["06-fp8", "07-context-parallel", "08-pipeline-parallel", "09-expert-parallel", "10-nd-parallel"]
)
def test_a_forked_chapter_runs_from_its_folder_and_common(chapter, tmp_path):
    """README's fork: the chapter's .py files and common/ copied into one folder run with python, and
    import nothing from the repository (the chapters with modules of their own); without torchrun the
    script stops at its first check, after every import."""
    fork = tmp_path / "fork"
    shutil.copytree(REPO / "common", fork / "common")
    for script in (REPO / chapter).glob("*.py"):
        shutil.copy(script, fork)
    env = {**os.environ, "REPO": f"{REPO}/"}
    proc = subprocess.run(
        [sys.executable, "-c", FORK_PROBE], cwd=fork, env=env, capture_output=True, text=True, timeout=300
    )
    assert "error: start this chapter with torchrun" in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip() == "", f"imported from the repository: {proc.stdout}"


def test_flops_per_token_counts_every_matmul_once_tied_or_not():
    """6 FLOPs per matmul weight and token, by hand from the shapes, plus attention (PaLM, app. B)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import flops_per_token

    config = AutoConfig.from_pretrained(DEFAULT_MODEL)
    h, kv, inter, vocab, layers = 128, 4 * 16, 384, 512, 4  # hidden, k/v width, MLP, vocab, blocks
    block = h * h + 2 * h * kv + h * h + 3 * h * inter  # q, k and v, o, gate/up/down
    attention = 12 * layers * 8 * 16 * 128  # heads x head_dim x seq_length
    for tied in [False, True]:
        config.tie_word_embeddings = tied
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        # Tied or not, the output head is a full matmul; the input embedding is a lookup.
        assert flops_per_token(model, config, 128) == 6 * (layers * block + vocab * h) + attention
    # Llama-3.2-1B's shape (tied): all 1.236e9 parameters but the norms are matmul weights, the
    # embedding counted once, as the head; without the head, 21% of the FLOPs would go missing.
    config = AutoConfig.from_pretrained(REPO / "tools" / "llama_1b_shape")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert flops_per_token(model, config, 2048) == 6 * (1_235_814_400 - 33 * 2048) + 12 * 16 * 32 * 64 * 2048


def test_flops_per_token_counts_the_experts_a_token_goes_through():
    """A mixture of experts (the tiny Qwen3-MoE, chapter 09's default): each token through 2 of each layer's
    8 experts (gate, up and down of width 64), not all 8, and not none (its stacked weights are no
    nn.Linear)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import DEFAULT_MOE_MODEL, flops_per_token

    config = AutoConfig.from_pretrained(DEFAULT_MOE_MODEL)
    h, kv, expert, vocab, layers = 128, 4 * 16, 64, 512, 4
    block = h * h + 2 * h * kv + h * h + 2 * 3 * h * expert  # q, k and v, o, 2 experts' gate/up/down
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert flops_per_token(model, config, 128) == 6 * (layers * block + vocab * h) + 12 * layers * 8 * 16 * 128


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA L40", 181e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA A10G", None),
        ("NVIDIA H20", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_flops_lookup_takes_the_exact_device(name, peak):
    from common.metrics import lookup_peak_flops

    assert lookup_peak_flops(name) == peak


def test_adamw_decays_the_weight_matrices_only_and_fsdp_keeps_the_groups():
    """Decay on the linear layers' and embedding's weights; none on norms (the tiny Llama has no
    biases). fully_shard turns the parameters into DTensors of the same full shape: same groups."""
    import torch.distributed as dist
    from harness import free_port
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from common import adamw_param_groups, transformer_blocks

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL))
    names = {id(p): name for name, p in model.named_parameters()}

    def grouped(model):
        decay, no_decay = adamw_param_groups(model, 0.1)
        assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
        return [sorted(names[id(p)] for p in group["params"]) for group in (decay, no_decay)]

    decay, no_decay = grouped(model)
    assert all(name.endswith(("proj.weight", "embed_tokens.weight", "lm_head.weight")) for name in decay)
    assert all(name.endswith("norm.weight") for name in no_decay) and len(no_decay) == 2 * 4 + 1
    assert len(decay) + len(no_decay) == len(names)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for block in transformer_blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        names = {id(p): name for name, p in model.named_parameters()}
        assert all(type(p).__name__ == "DTensor" for p in model.parameters())
        assert grouped(model) == [decay, no_decay]
    finally:
        dist.destroy_process_group()


def test_async_checkpoints_hold_their_steps_weights_and_are_copied_and_published_beside_training(tmp_path, monkeypatch):
    """AsyncCheckpoints in one process (a gloo group of 1), as the chapters use it, with its copy to CPU
    memory slowed to 0.1 s per tensor: the step after a save waits for the copy before changing the
    weights, so every checkpoint holds the weights of its step; the copy's CPU memory is the same in
    every save; rank 0 publishes in a thread, not the training one; a full disk ends in one line, at the
    last save's wait or at the next step."""
    import errno
    import threading
    import time

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from harness import free_port
    from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import common.async_checkpoints
    from common import AsyncCheckpoints, checkpoint_dir

    copies, copied_at = [], []
    stage = StateDictStager._stage_untyped_storage

    def slow_stage(self, storage, non_blocking=False):
        time.sleep(0.1)
        copy = stage(self, storage, non_blocking)
        copies.append(copy.data_ptr())
        copied_at.append(time.perf_counter())
        return copy

    monkeypatch.setattr(StateDictStager, "_stage_untyped_storage", slow_stage)
    publishers = []
    publish = common.async_checkpoints.publish_checkpoint

    def publish_in_which_thread(*args):
        publishers.append(threading.current_thread())
        publish(*args)

    monkeypatch.setattr(common.async_checkpoints, "publish_checkpoint", publish_in_which_thread)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        saves = AsyncCheckpoints(1, torch.device("cpu"), optimizer)

        def train_step():
            model(torch.randn(4, 8)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

        def save(step, keep=2):
            final_dir = checkpoint_dir(tmp_path, step)
            tmp_dir = final_dir.with_name(final_dir.name + ".tmp")
            tmp_dir.mkdir(parents=True)
            model_state, optimizer_state = get_state_dict(model, optimizer)
            saves.start({"model": model_state, "optimizer": optimizer_state}, tmp_dir, final_dir, step, keep)
            return time.perf_counter(), {name: value.clone() for name, value in model_state.items()}

        weights = {}
        train_step()
        for step in [1, 2, 3]:
            returned_at, weights[step] = save(step)
            train_step()
            assert returned_at < copied_at[-1]  # the copy went on beside training
        saves.close()

        checkpoints = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
        assert checkpoints == ["step-00000002", "step-00000003"]
        for step in [2, 3]:
            loaded = {"model": {name: torch.zeros_like(value) for name, value in weights[step].items()}}
            dcp.load(loaded, checkpoint_id=checkpoint_dir(tmp_path, step))
            assert all(torch.equal(loaded["model"][name], weights[step][name]) for name in weights[step]), step
        # 8 tensors per save (2 weights, their 2 moments and step counts), copied into the same memory.
        assert len(copies) == 3 * 8 and copies[:8] == copies[8:16] == copies[16:]
        assert len(publishers) == 3 and threading.main_thread() not in publishers

        def full_disk(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(common.async_checkpoints, "publish_checkpoint", full_disk)
        saves = AsyncCheckpoints(1, torch.device("cpu"), optimizer)
        save(4)
        with pytest.raises(SystemExit, match="no space left .* saving step 4; the checkpoint of step 3 is intact"):
            saves.close()
        # A save that fails while training goes on stops the job at the next optimizer step.
        save(5)
        saves.pending[1].exception(timeout=60)  # its publishing has failed
        with pytest.raises(SystemExit, match="no space left .* saving step 5; the checkpoint of step 3 is intact"):
            train_step()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chapter, args", [
    ("02-multi-gpu", []),  # DDP: chapters 01 to 03's loop
    ("06-fp8", ["--fp8-emulate", "--fp8-stats-every", "4", "--async-checkpoints", "--ckpt-freq", "4"]),
])  # fmt: skip
def test_the_host_waits_for_the_device_only_at_logging_steps(tmp_path, hf_home, chapter, args):
    """A GPU runs ahead of the host until the host asks for a tensor's value (.item(), float(t), `if t:`)
    or copies host data to it (torch.tensor(x, device=...)): then the GPU drains and idles. The probe
    records each such call that a line of the chapters or of common/ makes: between logging steps
    (every 4th here) there must be none, FP8's statistics steps and gradient accumulation included,
    but the batches, made on the host by design, and the CPU's StopSignal.agreed, which reads its flag
    at once there (on a GPU one step later, without waiting). What no CPU run shows: CUDA-only code
    (CUDA events, pinned copies). Found this way: FP8's statistics made 140 tensors from host numbers
    (torch.tensor) on each statistics step."""
    from harness import FAST_ARGS, run_chapter

    probe = tmp_path / "host_syncs.jsonl"
    run_args = [*FAST_ARGS, "--log-freq", "4", "--eval-every", "100", "--max-steps", "8", "--grad-accum-steps", "2"]
    run_chapter(chapter, *run_args, *args, "--save-dir", str(tmp_path), nproc=2, hf_home=hf_home,
                faults={"PROBE_HOST_SYNCS": probe})  # fmt: skip
    steps = {}  # steps finished -> what the host waited for since then, through the next step's end
    for line in probe.read_text().splitlines():
        record = json.loads(line)
        steps[record["steps_finished"]] = {event.split(":")[0] + " " + event.split()[-1] for event in record["events"]}
    assert sorted(steps) == list(range(9)), steps
    expected = {
        "from host common/data.py _rows",  # the batch: made on the host, copied from pinned memory without waiting
        "read common/signals.py agreed",  # on the CPU only
    }
    between_logs = {step: events - expected for step, events in steps.items() if step % 4}
    assert between_logs == dict.fromkeys(between_logs, set()), between_logs
    assert f"read {chapter}/train_llm.py main" in steps[4]  # the log line reads the loss: the probe sees it


def test_a_stop_signal_is_every_ranks_at_the_same_step(monkeypatch):
    """A SIGTERM that lands after this rank's "any signal?" flag went into the step's all-reduce is not
    in the answer the other ranks got: this rank must stop with them, at the next step, not alone now
    (alone, it waits for them in its checkpoint's barrier while they wait in the next step's all-reduce,
    until torchrun kills the job 30 s later with no checkpoint)."""
    import signal

    from common import StopSignal, distributed, logs

    monkeypatch.setattr(logs, "_wandb_calls", True)  # the handler turns wandb's calls off: restored after

    def all_reduce_then_signal(flag, op=None):  # no other rank had one; this one's arrives just after
        os.kill(os.getpid(), signal.SIGTERM)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        stop = StopSignal()
        with monkeypatch.context() as patch:
            patch.setattr(distributed.dist, "all_reduce", all_reduce_then_signal)
            assert stop.agreed(torch.device("cpu")) is None  # the step's answer, every rank's
        assert stop.name == "SIGTERM"
        monkeypatch.setattr(distributed.dist, "all_reduce", lambda flag, op=None: None)
        assert stop.agreed(torch.device("cpu")) == "SIGTERM"  # the next step's, every rank's too
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

import faulthandler
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
from harness import PROCESS_MARK, kill_marked, new_process_mark

# The files whose tests cost the most CPU, most first (measured: BENCHMARKS.md, The test suite). pytest-xdist's
# --dist loadfile hands each worker one file at a time in the order collected; heaviest first, no worker
# is still in a long file (or a single-threaded one, test_real_layouts) while the others stand idle at
# the end. Files not listed come first: a new file is most likely a chapter's.
HEAVIEST_FIRST = ["test_04_fsdp.py", "test_docs_walkthrough.py", "test_01_single_gpu.py", "test_03_multi_node.py",
                  "test_06_fp8.py", "test_docs_real_hardware.py", "test_02_multi_gpu.py", "test_real_layouts.py",
                  "test_05_tensor_parallel.py", "test_07_context_parallel.py", "test_tools.py",
                  "test_08_pipeline_parallel.py", "test_common.py", "test_model_families.py", "test_preflight.py",
                  "test_diagnosing.py", "test_bad_input.py", "test_gpu.py"]  # fmt: skip


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # pytest's first process: its pytest-xdist workers inherit the folder
        os.environ[STUCK] = tempfile.mkdtemp(prefix="stuck-tests-")
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's default: the files with most tests first
        config.option.loadscopereorder = False
    # One math thread in the tests' own processes too, as chapter_env gives the runs they launch: on two
    # cores shared by three workers and their runs, a second thread only waits (test_real_layouts alone
    # takes 12% less CPU time).
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, -1))  # stable: a file's tests keep their order


# A test that runs longer than this is stuck (the longest, the docs' dry runs with their setup, takes
# about 5 minutes on 2 busy cores). PROBE_TEST_TIME_LIMIT sets another (for the watchdog's own test).
TEST_TIME_LIMIT = float(os.environ.get("PROBE_TEST_TIME_LIMIT", "1200"))
STUCK = "PROBE_STUCK_TESTS"  # the folder where a stuck test's process writes its stacks, made by pytest's first process


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A stuck test must not stall the suite: whatever waits without a time limit of its own (a lock, a
    collective, a call in this process), once the test (setup, call and teardown) outlives
    TEST_TIME_LIMIT, every thread's stack is written and the process exits, which pytest-xdist reports
    as that test's failure ("worker crashed") and replaces the worker; the other tests go on. The
    summary at the end shows the stacks (pytest_terminal_summary)."""
    with open(os.path.join(os.environ[STUCK], f"{os.getpid()}.txt"), "w") as stacks:
        stacks.write(f"{item.nodeid} still ran after {TEST_TIME_LIMIT:.0f} s:\n")
        stacks.flush()
        faulthandler.dump_traceback_later(TEST_TIME_LIMIT, exit=True, file=stacks)
        yield
        faulthandler.cancel_dump_traceback_later()
        stacks.truncate(0)


def pytest_terminal_summary(terminalreporter):
    for path in sorted(Path(os.environ[STUCK]).glob("*.txt")):
        if text := path.read_text():
            terminalreporter.write_sep("=", "stuck test")
            terminalreporter.write(text)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(STUCK), ignore_errors=True)


@pytest.fixture(autouse=True)
def end_the_processes_of_each_test(monkeypatch):
    """Every process a test starts inherits its mark (harness.PROCESS_MARK); whatever still runs when
    the test ends, after a timeout, a failed assertion or an exception, is killed then, not left to
    load the machine for the tests after it. What it was is printed (shown with a failure)."""
    mark = new_process_mark()
    monkeypatch.setenv(PROCESS_MARK, mark)
    yield
    left = kill_marked(mark)
    if left:
        print(f"killed {len(left)} processes the test left running:", *left, sep="\n  ")


@pytest.fixture(autouse=True)
def torch_configs_restored():
    """A test that changes torch's compile settings (inductor's, dynamo's) must restore them: every later
    test of its worker would compile with them, and which tests those are depends on the file order.
    A change left behind fails the test that left it, and is undone."""
    import torch._dynamo.config
    import torch._inductor.config

    def values(config):  # a setting deleted (as unittest.mock does) reads as missing
        with warnings.catch_warnings():  # reading a deprecated setting warns
            warnings.simplefilter("ignore", FutureWarning)
            return {name: getattr(config, name, "<deleted>") for name in config.get_config_copy()}

    configs = [torch._inductor.config, torch._dynamo.config]
    before = [values(config) for config in configs]
    yield
    left = []
    for config, old in zip(configs, before):
        for name, value in values(config).items():
            if value != old[name]:
                left.append(f"{config.__name__}.{name}: {old[name]!r} -> {value!r}")
                setattr(config, name, old[name])
    assert not left, f"the test left torch settings changed (use config.patch): {'; '.join(left)}"


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory):
    """One Hugging Face cache for the session: the tiny dataset is tokenized once, not once per test."""
    return tmp_path_factory.mktemp("hf_home")


def _shared_run(tmp_path_factory, name: str, run):
    """`run(save_dir)` once per session: the first pytest-xdist worker to need it runs it, under a lock
    in the folder all workers share, and the others read it. Tests copy it, never write to it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    save_dir, complete = shared / name, shared / f"{name}.complete"
    with FileLock(shared / f"{name}.lock"):
        if not complete.exists():  # a run that failed half-way is made again
            shutil.rmtree(save_dir, ignore_errors=True)
            run(save_dir)
            complete.touch()
    return save_dir


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory, hf_home):
    """Chapter 02 on 2 ranks for 12 steps of FAST_ARGS, logging to W&B offline: the reference run that
    chapter 02 compares with chapter 01, and chapters 03 to 06 with chapter 02. A late release by gloo's
    worker at its exit (harness.late_release)."""
    from harness import FAST_ARGS, OFFLINE_WANDB, late_release, run_chapter

    def run(save_dir):
        args = [*FAST_ARGS, "--max-steps", "12", "--experiment-name", "ddp", "--save-dir", str(save_dir)]
        faults = late_release(save_dir)
        proc = run_chapter("02-multi-gpu", *args, nproc=2, hf_home=hf_home, env=OFFLINE_WANDB, faults=faults)
        (save_dir / "ddp.stderr").write_text(proc.stderr)  # beside the run: what it warned (none: no straggler)

    return _shared_run(tmp_path_factory, "ddp_reference", run) / "ddp"


@pytest.fixture(scope="session")
def fsdp_reference(tmp_path_factory, hf_home):
    """Chapter 04 on 2 ranks for 12 steps of FAST_ARGS (8 rows per step), exported with --export-hf (to
    `hf`), its weights' bytes probed (`state.json`) and what it printed kept (`stderr.txt`): the run
    chapter 04's tests check, and the one chapter 07's context parallel layouts must equal."""
    from harness import FAST_ARGS, run_chapter

    def run(save_dir):
        args = [*FAST_ARGS, "--max-steps", "12", "--save-dir", str(save_dir), "--export-hf", str(save_dir / "hf")]
        probe = {"PROBE_STATE_BYTES": save_dir / "state.json"}
        proc = run_chapter("04-fsdp", *args, nproc=2, hf_home=hf_home, faults=probe)
        (save_dir / "stderr.txt").write_text(proc.stderr)

    return _shared_run(tmp_path_factory, "fsdp_reference", run)


@pytest.fixture(scope="session")
def chapter_01_reference(tmp_path_factory, hf_home):
    """Chapter 01 for 12 steps of FAST_ARGS with ddp_reference's global batch (2 ranks x 4 rows): what
    chapter 02 must reproduce, and one of the runs the plot test draws."""
    from harness import FAST_ARGS, run_chapter

    def run(save_dir):
        args = [*FAST_ARGS, "--batch-size", "8", "--max-steps", "12", "--save-dir", str(save_dir)]
        run_chapter("01-single-gpu", *args, hf_home=hf_home)

    return _shared_run(tmp_path_factory, "chapter_01_reference", run) / "01-single-gpu"


@pytest.fixture(scope="session")
def tied_bf16_fsdp_reference(tmp_path_factory):
    """Chapter 04 on 2 ranks for 3 steps of FAST_ARGS (8 rows per step) on the tiny model with tied
    embeddings, published in bf16 as Llama-3.2-1B is (in `model`), exported with --export-hf (to
    `hf`). Chapter 04's export test reads it, and chapter 05's tied-embeddings test compares with it.
    The same run is chapter 04's test of a data preparation that outlasts the collective timeout:
    with its own empty cache, rank 0 prepares the data 20 s more slowly than it can, under
    --dist-timeout 0.25 (15 s), and the run in which a rank once aborted after "Done" (a late release
    by gloo's worker at exit: harness.late_release makes it certain)."""
    import torch
    from harness import FAST_ARGS, REPO, late_release, run_chapter
    from transformers import AutoConfig

    def run(save_dir):
        model_dir = save_dir / "model"
        shutil.copytree(REPO / "common" / "tiny_llama", model_dir)
        config = AutoConfig.from_pretrained(model_dir)
        config.tie_word_embeddings, config.dtype = True, torch.bfloat16
        config.save_pretrained(model_dir)
        args = [*FAST_ARGS, "--model-name", str(model_dir), "--max-steps", "3", "--export-hf", str(save_dir / "hf")]
        args += ["--dist-timeout", "0.25", "--save-dir", str(save_dir)]
        faults = {"FAULT_SLOW_DATA": 20, **late_release(save_dir)}
        run_chapter("04-fsdp", *args, nproc=2, hf_home=save_dir / "hf_home", faults=faults)

    return _shared_run(tmp_path_factory, "tied_bf16_fsdp_reference", run)

"""Test-only faults and probes. Python imports this file at the start of every process the tests
launch (tests/harness.py's chapter_env puts its folder on PYTHONPATH), so the training scripts carry
no test hooks. Environment variables switch them on; this table is the one list of them all.

Faults (faults.py) make a run fail as a real one can:

FAULT_KILL_AFTER_CHECKPOINT=N   SIGKILL this process right after its N-th checkpoint is published.
FAULT_KILL_DURING_CHECKPOINT=N  SIGKILL this process half-way through a file of its N-th checkpoint.
FAULT_KILL_DURING_SHARD_WRITE=N SIGKILL rank FAULT_RANK (default 0) half-way through writing its shards of its
                                N-th DCP checkpoint (chapters 04-06; with --async-checkpoints, in the writing thread).
FAULT_KILL_DURING_EXPORT=1      SIGKILL rank FAULT_RANK (default 0) once it has merged its files of --export-hf
                                (torch's consolidation of the ranks' shards), before the folder is published.
FAULT_KILL_DURING_EXPORT_PUBLISH=N  SIGKILL rank 0 before the N-th step of putting a finished --export-hf in an earlier
                                export's place (published.replace_export: the swap of the folders, or the two renames
                                without it; the earlier export's removal).
FAULT_NO_RENAME_EXCHANGE=1      the export's file system cannot swap two folders (NFS): published.swap_folders declines.
FAULT_SLOW_SHARD_WRITE=S        rank FAULT_RANK writes its shards of every DCP checkpoint S seconds more slowly.
FAULT_RAISE_AT_STEP=N           raise in the N-th optimizer step, on the rank FAULT_RANK (default 0).
FAULT_KILL_AT_STEP=N            SIGKILL in the N-th optimizer step, on the rank FAULT_RANK (default 0).
FAULT_NAN_AT_STEP=N             after the N-th optimizer step of rank FAULT_RANK, a weight becomes NaN.
FAULT_SIGNAL_AT_STEP=N          in the N-th optimizer step of rank FAULT_RANK, send FAULT_SIGNAL (default
                                TERM) to this process, or with FAULT_SIGNAL_PARENT=1 to its parent
                                (torchrun): as a scheduler would, at a step boundary that tests can name.
                                One *_AT_STEP fault at a time: with several set, the first of these four.
FAULT_LATE_RELEASE_AT_EXIT=dir at the run's destroy_process_group, a gloo worker lets go of a collective's tensor
                                after the main thread has ended the run, and waits in Python until the interpreter
                                shuts down (faults.py): a process that exits through Python's shutdown aborts.
                                Each rank writes dir/late-release-rank-R.txt: the thread that let go of it.
FAULT_SLOW_DATA=S               rank 0 prepares the data (load_and_pack) S seconds more slowly.
FAULT_SLOW_MATMUL=S             every torch.matmul of rank FAULT_RANK takes S seconds more: a throttled GPU, as
                                python -m tools.preflight measures one.
FAULT_SLOW_BATCH=S              every batch a DataLoader of rank FAULT_RANK yields takes S seconds more: a slow data path.
FAULT_SLOW_BLOCK=S              every Llama block's forward on rank FAULT_RANK takes S seconds more: a slow GPU, in
                                the forward compute (under FSDP, after the block's all-gather).
FAULT_FP8_SCALE=F               every FP8 scale torchao computes is F x the right one: in amax_to_scale (inputs,
                                output gradients, weights cast one by one) and in the weight scales
                                precompute_float8_dynamic_scale_for_fsdp sets for FSDP's FP8 all-gathers. The FP8
                                tensor keeps that scale, so with F > 1 every value above amax / F clamps.
FAULT_EXPERTS_UNUSED_FROM=N     Qwen3-MoE's routers never choose experts N and above: under expert parallelism, the
                                ranks that hold only those receive no tokens (chapter 09).

A fault strikes once: when torchrun restarts the workers (TORCHELASTIC_RESTART_COUNT > 0), none is
armed, the FAULT_SLOW_* ones excepted (they slow every attempt).

Probes (probes.py, scaled_mm_shapes.py) change nothing the script computes:

PROBE_COMPILE_COUNTS=path       after every optimizer step of rank 0, append to `path` a JSON line with the
                                graphs torch.compile has handed its backend so far (a recompile adds one: counted
                                by a backend that records each graph, the same in every torch version), dynamo's
                                graph breaks, and each graph's checkpoint regions (the name of each region's
                                context_fn: null for full checkpointing, _selective_context for selective).
PROBE_STATE_BYTES=path          at the first optimizer step of rank 0, write to `path` a JSON object
                                with the bytes of its weights, gradients (DDP's all-reduce buckets
                                included) and AdamW's moments: each storage once, a sharded tensor
                                (DTensor) by its local piece. What python -m tools.plan predicts.
PROBE_GRADIENT_REDUCTIONS=path  before every optimizer step of rank 0, append to `path` a JSON line with
                                the collectives that reduced the step's gradients: "ddp_buckets", the
                                indices of the buckets DDP all-reduced (through a comm hook that does what
                                DDP does by default), and "reduce_scatters", how many FSDP issued.
PROBE_HOST_SYNCS=path           on rank 0, the host's waits for the device that a line of the repository
                                makes (a tensor's value read: .item(), float(t), `if t:`; a tensor made from
                                host data: torch.tensor), a JSON line per step: the steps finished before them
                                and "file:line function" of each.
PROBE_SCALED_MM_SHAPES=1        every emulated FP8 matmul (torchao, --fp8-emulate) first runs torch._scaled_mm
                                on meta tensors of its operands: fails where an H100's kernel would, on shapes
                                (scaled_mm_shapes.py).
PROBE_COMPILE_BACKEND=eager     torch.compile traces with dynamo as usual, then runs the traced graphs
                                as they are instead of generating kernels: what was traced, and how
                                often, is the same, in seconds instead of minutes on a small CPU.
PROBE_EXPERT_COUNTS=dir         at every call of Qwen3-MoE's experts in a training forward (not evaluation's nor
                                activation checkpointing's recompute), the tokens the router sent to each expert,
                                a JSON line in dir/expert-counts-rank-R.jsonl.
PROBE_MAX_STEPS=N               a chapter's run ends after N steps, as with --max-steps N (or its own, if
                                fewer), and evaluates on at most N batches, as with --eval-batches N: the
                                docs' commands in the suite's time, never edited (test_docs_*).
PROBE_STEPS=path                a line in `path` for every training step of rank 0 (an optimizer step after a
                                backward: DCP's resume steps on zero gradients to make AdamW's state).
PROBE_DRY_RUN=path              the process plays rank RANK of WORLD_SIZE on the fake process group, with fake
                                tensors from the first model built: the command's checks, data, model, layout
                                and first optimizer step, then `path` says what was built and it exits 0
                                (dry_run.py; the docs' commands for real hardware).
PROBE_DRY_RUN_BLOCKS=N          every model config loaded has at most N blocks, at its real widths.

Each function is replaced or hooked once, whatever is switched on. The optimizer step is hooked
through torch's own global step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook and
_post_hook), which run in the order they were registered: the probes are imported first, so before a
step and after it, the probes record first and a fault strikes after them (a probe sees every step
that began, the one a fault stops included). DistributedDataParallel.__init__ is wrapped once, by
probes.py, for the probes that need each DDP model.
"""

import gc

# No garbage collection during the imports: torch, transformers and datasets make ~370k objects that
# the collector would scan again and again, 10% of the suite's CPU time. Every chapter calls
# gc.freeze() in main once its imports are done; from there on it collects as it does for users.
gc.disable()
_gc_freeze = gc.freeze


def _freeze_then_collect():
    _gc_freeze()
    gc.enable()


gc.freeze = _freeze_then_collect

import probes  # noqa: E402,F401  (first: see the order above)
import faults  # noqa: E402,F401

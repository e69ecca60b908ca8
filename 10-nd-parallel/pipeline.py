"""Chapter 08's pipeline.py, grown by what the composed mesh sends between stages (its diff from 08's is
in this chapter's README): the stages' shapes with each row's tokens cut over cp and the hidden states
over tp, and plain tensors across a stage's boundary under TP. Below, 08's words.

The model cut into pipeline stages: which blocks each stage holds, each stage's module, the checks
that refuse what the cut cannot take, and the norm of all stages' gradients. The schedule, the stages' sends and receives and FSDP's part in them
are PyTorch's (torch.distributed.pipelining); this module only says what a stage is for a Hugging Face
causal LM, as torchtitan's pipeline_module_split does for its own models.

Every rank keeps one model (the chapter's `model`) holding the modules of its stages under their usual
names (`model.layers.3.mlp...`): the optimizer, the checkpoints and the gradient norm see it as chapter
04 does, so a checkpoint is the same set of names whatever --pp-size saved it, and DCP reshards it. Each
of its stages is another instance of the model's class, on the meta device, holding the same modules
(shared, not copied) for its part: the embeddings on the first stage, its blocks, the final norm and the
output layer on the last. The blocks of other stages are PassThrough placeholders, so that HF's own
forward runs unchanged on each stage, rotary position embeddings (computed in that forward from the
positions) included: the first stage from the token ids, the others from the hidden states they receive
(HF's `inputs_embeds`), the last one to the logits.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
from torch.distributed.tensor import DTensor, Shard
from transformers import AutoModelForCausalLM

# The schedules the chapter runs: one stage per rank (GPipe: all forwards, then all backwards; 1F1B: a
# backward as soon as one can run), or STAGES_PER_RANK stages per rank, looped over the ranks
# (Interleaved1F1B, and LoopedBFS: each stage's micro-batches in turn). Not the zero-bubble schedules, which
# split each backward into its input's and its weights' gradients: not tested here with FSDP.
SCHEDULES = ["1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS"]
STAGES_PER_RANK = 2  # with the looped schedules: torchtitan's default (more: a smaller bubble, more sends)

# The families whose forward does nothing to the hidden states outside the blocks but the embedding (at its
# start) and the final norm (at its end), so that a stage that skips them computes what the whole model
# does: Llama's layout (model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head). Tested
# (tests/test_08_pipeline_parallel.py): each stage's output chained equals the whole model's logits.
# Not GPT-2 (another layout, and position embeddings added to the input), Granite (its forward scales
# the input embeddings, which a later stage would do again), nor tied embeddings across stages.
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "olmo2", "phi3", "gemma3_text"]
FAMILIES += ["qwen2_moe", "qwen3_moe", "deepseek_v3"]  # mixtures of experts: their MoE blocks are blocks


def check_layout(args, world_size: int, shard_size: int) -> None:
    """Refuses a --pp-size, --shard-size or micro-batch count the ranks, the rows or the schedule cannot take."""
    if world_size % args.pp_size:
        raise SystemExit(f"error: --pp-size {args.pp_size} must divide the number of ranks ({world_size})")
    dp_size = world_size // args.pp_size
    if dp_size % shard_size:
        raise SystemExit(
            f"error: --shard-size {shard_size} must divide the {dp_size} ranks that hold each stage "
            f"(ranks / --pp-size)"
        )
    rows, microbatches = args.pp_size * args.batch_size, microbatch_count(args)
    if rows % microbatches:
        raise SystemExit(
            f"error: --pp-microbatches {microbatches} must divide the {rows} rows a pipeline trains at once "
            f"(--pp-size x --batch-size)"
        )
    looped = args.pp_schedule in ("Interleaved1F1B", "LoopedBFS")
    if microbatches < args.pp_size or (looped and microbatches % args.pp_size):
        need = "a multiple of" if looped else "at least"
        raise SystemExit(
            f"error: --pp-microbatches {microbatches}: --pp-schedule {args.pp_schedule} needs {need} --pp-size "
            f"({args.pp_size}) micro-batches, one in flight per stage; pass a larger --batch-size or --pp-microbatches"
        )


def microbatch_count(args) -> int:
    """--pp-microbatches, by default one per row: the smallest bubble the rows allow (torchtitan's default)."""
    return args.pp_microbatches or args.pp_size * args.batch_size


def check_model(model, blocks, args) -> None:
    """Refuses, in one line and before anything is cut, a model the stages cannot be made of."""
    config, name = model.config, type(model).__name__
    if config.model_type not in FAMILIES:
        raise SystemExit(
            f"error: --pp-size {args.pp_size}: the stages are cut from Llama-style models ({', '.join(FAMILIES)}; "
            f"see README); {name} ({config.model_type}) is not one of them"
        )
    stages = args.pp_size * stages_per_rank(args.pp_schedule)
    if len(blocks) < stages:
        raise SystemExit(
            f"error: --pp-size {args.pp_size} with --pp-schedule {args.pp_schedule} makes {stages} stages, more "
            f"than the model's {len(blocks)} blocks; pass a smaller --pp-size or a one-stage-per-rank schedule"
        )
    if args.pp_size > 1 and getattr(config.get_text_config(), "output_router_logits", False):
        raise SystemExit(
            f"error: --pp-size {args.pp_size}: {name}'s config asks for the routers' balancing loss "
            "(output_router_logits), which HF computes over every block's router logits at once, and no stage "
            "holds them all: set it false in the model's config.json, or use --pp-size 1"
        )
    if args.pp_size > 1 and config.tie_word_embeddings:
        raise SystemExit(
            f"error: --pp-size {args.pp_size}: {name} ties its output layer to its input embeddings, which "
            "would be on the first stage and the last: untie them (tie_word_embeddings false) or use --pp-size 1"
        )


def stages_per_rank(schedule: str) -> int:
    return STAGES_PER_RANK if issubclass(get_schedule_class(schedule), PipelineScheduleMulti) else 1


def rank_stages(args, pp_rank: int) -> tuple[int, list[int]]:
    """The number of stages, and this pp rank's: r, and with looped schedules r + pp, r + 2 pp, ..."""
    num_stages = args.pp_size * stages_per_rank(args.pp_schedule)
    return num_stages, list(range(pp_rank, num_stages, args.pp_size))


def stage_blocks(num_blocks: int, num_stages: int, stage: int) -> range:
    """The blocks of a stage: as many on each, the first stages one more when they do not divide evenly."""
    per_stage, extra = divmod(num_blocks, num_stages)
    start = stage * per_stage + min(stage, extra)
    return range(start, start + per_stage + (stage < extra))


class PassThrough(nn.Module):
    """A block of another stage: HF's loop over the blocks runs on, the hidden states unchanged."""

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def split(model, blocks, stages: list[int], num_stages: int) -> tuple[list[nn.Module], list[nn.Module]]:
    """`model` pruned to the modules of this rank's `stages` (the others' become None or PassThrough), and
    a module per stage holding its share of them (another instance of the model's class); and this
    rank's blocks, in order."""
    config, layers = model.config, model.model.layers  # the blocks, or what wraps each (checkpointing)
    if len(layers) != len(blocks):
        raise SystemExit(f"error: --pp-size: {type(model).__name__}'s blocks are not its model.layers")
    owned = {stage: stage_blocks(len(blocks), num_stages, stage) for stage in stages}
    stage_modules = []
    for stage, stage_block_ids in owned.items():
        with torch.device("meta"):  # shapes only: its modules are replaced by the model's own
            part = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        part.model.embed_tokens = model.model.embed_tokens if stage == 0 else None
        part.model.layers = nn.ModuleList(
            layers[i] if i in stage_block_ids else PassThrough() for i in range(len(blocks))
        )
        last = stage == num_stages - 1
        part.model.norm = model.model.norm if last else nn.Identity()  # the last stage's hidden states only
        part.lm_head = model.lm_head if last else None
        part.model.rotary_emb = model.model.rotary_emb  # every stage rotates its own queries and keys
        part.forward = _stage_forward(part, first=stage == 0, last=last)
        unknown = {n for n, t in [*part.named_parameters(), *part.named_buffers()] if not _is_in(t, model)}
        if unknown:  # a module the cut does not know of would be left uninitialized, or trained apart
            raise SystemExit(f"error: --pp-size: the stages do not know {', '.join(sorted(unknown))}")
        stage_modules.append(part)
    kept = {i for stage_block_ids in owned.values() for i in stage_block_ids}  # the blocks of all its stages
    model.model.layers = nn.ModuleList(layers[i] if i in kept else PassThrough() for i in range(len(blocks)))
    if 0 not in owned:
        model.model.embed_tokens = None
    if num_stages - 1 not in owned:
        model.model.norm, model.lm_head = None, None
    return stage_modules, [blocks[i] for i in sorted(kept)]


def _is_in(tensor, model) -> bool:
    return any(tensor is t for t in [*model.parameters(), *model.buffers()])


def _stage_forward(part, first: bool, last: bool):
    """The stage's forward, as PipelineStage calls it: token ids (the first stage) or the previous
    stage's hidden states in; the hidden states, or the logits (the last stage), out. The keyword
    arguments the schedule's step was given (each rank's, to all its stages: position ids) go to
    HF's forward."""
    causal_lm_forward = type(part).forward  # HF's, without FSDP's hooks (its own call runs them)

    def forward(inputs, **kwargs):
        given = {"input_ids": inputs} if first else {"inputs_embeds": inputs}
        if last:
            return causal_lm_forward(part, **given, **kwargs, use_cache=False).logits
        return part.model(**given, **kwargs, use_cache=False).last_hidden_state

    return forward


def shapes(args, config, dtype, stage: int, num_stages: int, tp_rank: int) -> dict:
    """The stage's input and output per micro-batch, given to PipelineStage so that it need not find them
    by running a forward and backward (through FSDP) first: each row's tokens cut over cp, the hidden
    states over tp (sequence parallel), the logits' vocabulary over tp (unevenly: torch.chunk's)."""
    rows = args.pp_size * args.batch_size // microbatch_count(args)
    tokens = args.seq_length // args.cp_size
    vocab = len(torch.arange(config.vocab_size).chunk(args.tp_size)[tp_rank])
    with torch.device("meta"):  # the hidden states need gradients: those are what the stages send back
        hidden = torch.empty(rows, tokens // args.tp_size, config.hidden_size, dtype=dtype, requires_grad=True)
        ids = torch.empty(rows, tokens, dtype=torch.long)
        logits = torch.empty(rows, tokens, vocab, dtype=dtype, requires_grad=True)
    return {"input_args": ids if stage == 0 else hidden, "output_args": logits if stage == num_stages - 1 else hidden}


def send_plain_tensors(stage_module, tp_mesh) -> None:
    """A stage's inputs and outputs as PipelineStage sends them, plain tensors, under TP: the
    hidden states this rank holds of the tokens (sequence parallel: 1/tp of them) leave as they
    are and arrive as the DTensor that chapter 05's blocks take (whose shape HF reads as the whole
    row's); the logits leave as this rank's part of the vocabulary (loss_parallel's)."""
    forward = stage_module.forward

    def forward_on_plain_tensors(inputs, **kwargs):
        if inputs.is_floating_point():  # the hidden states, from the stage before
            inputs = DTensor.from_local(inputs, tp_mesh, [Shard(1)], run_check=False)
        output = forward(inputs, **kwargs)
        return output.to_local() if isinstance(output, DTensor) else output

    stage_module.forward = forward_on_plain_tensors


def send_buffers(model, full_model, device) -> None:
    """Every rank calls this (a broadcast per buffer): the buffers no state dict holds (rotary frequencies, an
    embedding's scale), sent from rank 0's full model (`full_model`, else None), which holds every stage's,
    by its names, to the device (to_empty: maybe CPU); kept by the ranks whose stages hold them. Under TP
    some are DTensors, replicated over tp (Gemma's embedding scale): each tp rank keeps one."""
    rank = dist.get_rank()
    saved = full_model.state_dict() if rank == 0 else {}
    names = [rank == 0 and [(n, b.shape, b.dtype) for n, b in full_model.named_buffers() if n not in saved]]
    dist.broadcast_object_list(names, src=0)
    held = dict(model.named_buffers())
    for name, shape, dtype in names[0]:
        value = full_model.get_buffer(name).to(device) if rank == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(value, src=0)
        if isinstance(buffer := held.get(name), DTensor):
            value = DTensor.from_local(value, buffer.device_mesh, buffer.placements, run_check=False)
        if name in held:
            module_name, _, buffer_name = name.rpartition(".")
            setattr(model.get_submodule(module_name), buffer_name, value)


def name_every_stage(optimizer_state: dict) -> None:
    """Every rank calls this: the optimizer's groups as all ranks hold them together. Each group
    names its parameters, and a rank's names only its stages': DCP writes one copy of what is not a
    tensor (rank 0's), and another stage's ranks would find none of theirs in it when they load.
    Named in full, as chapter 04 names them, a checkpoint loads at any --pp-size, and in chapter 04.
    (A few kB per rank: the names of its stages' parameters.)"""
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, [group["params"] for group in optimizer_state["param_groups"]])
    for i, group in enumerate(optimizer_state["param_groups"]):
        group["params"] = list(dict.fromkeys(name for rank_names in names for name in rank_names[i]))


def clip_grad_norm_(parameters, max_norm: float, pp_group) -> torch.Tensor:
    """Every rank calls this: torch's clip_grad_norm_ over the whole model's gradients: each stage's
    norm (over its shards) squared, summed over the pp group, then every stage scaled by the total.
    A stage clipped by its own norm would no longer step where the model's gradient points."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads).full_tensor() ** 2
    dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_group)
    total_norm = total_norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm

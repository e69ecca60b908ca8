"""The checks and the bookkeeping around expert parallelism, beside the chapter: which layers are a
mixture of experts and what --ep-size, the model and the balancing flags can take (refused in one
line before anything is built), the experts split over the ep ranks and each token sent to its
experts' ranks and back (apply_expert_parallel, dispatch), the gradient norm over two meshes, the
experts' load, and the routing biases of DeepSeek-V3's balancing. The experts' mesh and their
sharding are the chapter's (train_llm.py).

Chapter 09's file, grown by what the composed mesh asks of it (its diff from 09's is in this
chapter's README): the model's experts checked against the layout (dims.py: their mesh), the
gradient norm and the experts' load over every pipeline stage, and the experts under TP, each tp
rank routing its own tokens (the blocks that hold them run eager; the gradients of what every tp
rank keeps whole summed over tp).

The experts are Hugging Face's own, through the contract every MoE family follows in transformers 5
(Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss, GLM-4.5, ...): a module called as
`experts(hidden_states, top_k_index, top_k_weights)`, holding each weight stacked over its experts
(`gate_up_proj` (E, 2I, H), `down_proj` (E, H, I), and biases where the family has them), which it
multiplies with grouped_mm by default. transformers' own expert parallelism
(`transformers/distributed/expert_parallel.py`, 5.2x) is applied only by `from_pretrained(
distributed_config=...)`, which the chapters do not use (they build the model on the meta device and
shard it themselves), and is missing from the 5.x versions pyproject.toml admits: the chapter does
the same thing, in its own 40 lines, on PyTorch's collectives.
"""

import contextlib
import functools
import inspect
import logging
import math
import re

import torch
import torch.distributed as dist

# Private, checked on torch 2.11-2.14 (its public torch.distributed.nn.functional version is
# deprecated for it). If it moves: chapter 09 fails at import: use the home that warning names.
import torch.distributed._functional_collectives as funcol
import transformers
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import common

logger = logging.getLogger(__name__)

# The norm of the experts' gradients, on their 2-D (efsdp, ep) mesh, is two all-reduces of one
# number each; DTensor warns at every step that one would do (on a flattened mesh). Not worth a
# flattened mesh.
# Its logger's name is private, checked on torch 2.11-2.14. If it moves: no error, the warning comes
# back at every step: quiet the logger of the module that then warns.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# grouped_mm on the CPU reads its operands in 16-byte steps: every width of an expert's weights must
# be a multiple of 16 bytes (4 fp32 numbers). GPUs ask the same of bf16 (8 numbers).
GROUPED_MM_ALIGNMENT = 16
# DeepSeek-V3's bias update speed (its paper's gamma, torchtitan's load_balance_coeff): the default
# --bias-update-rate of the families whose routers carry the bias.
BIAS_UPDATE_RATE = 1e-3
# transformers' names for the routing bias: DeepSeek-V3's and its kin's; LFM2-MoE's and AFMoE's.
ROUTING_BIASES = ("e_score_correction_bias", "expert_bias")
# The balancing loss's weight above which it outweighs the model's own loss (published: 0.001-0.02).
MAX_AUX_LOSS_COEF = 1.0


def check_composed(model: nn.Module, args, dtype: torch.dtype) -> list[nn.Module]:
    """The model's experts modules, all of them (none: a dense model), refused in one line where
    chapter 09 refuses them. The routers' balancing loss is HF's, over every block's router logits
    of a row at once, which the stages, cp and tp split over ranks: a config that asks for it is
    refused."""
    layers = common.experts_modules(model)
    flag = f"--model-name {model.config.name_or_path!r}"
    if not layers and args.ep_size > 1:
        raise SystemExit(f"error: --ep-size {args.ep_size}: {flag} is dense; pass --ep-size 1")
    if getattr(model.config.get_text_config(), "output_router_logits", False):
        raise SystemExit(
            f"error: {flag}'s config asks for the routers' balancing loss (output_router_logits), "
            "which HF computes over all of a row's router logits at once: this chapter cuts them "
            "over ranks; set it false in config.json (its routing biases: --bias-update-rate), or "
            "train with chapter 09"
        )
    return check_model(model, args, dtype) if layers else []


def check_model(model: nn.Module, args, dtype: torch.dtype) -> list[nn.Module]:
    """The model's experts modules, or one line naming what expert parallelism cannot take."""
    flag = f"--model-name {model.config.name_or_path!r} ({model.config.model_type})"
    layers = common.experts_modules(model)
    classes = [type(m).__name__ for m in model.modules()]
    moe = [name for name in classes if re.search("(moe|moeblock|experts)$", name, re.IGNORECASE)]
    if not layers and moe:  # a mixture of experts of its own kind (Doge's: experts as embeddings)
        raise SystemExit(
            f"error: {flag}: its mixture of experts ({moe[0]}) holds no `experts` module, as "
            "transformers 5's stacked experts are held: this chapter cannot split it; train it "
            "with chapter 04"
        )
    if not layers:
        raise SystemExit(
            f"error: {flag} is a dense model (no layer of routed experts): expert parallelism "
            "needs a mixture of experts (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3...); train a dense "
            "model with chapter 04"
        )
    for module in layers:
        gap = unstacked(module) or uncalled(module)
        if gap:
            name = type(module).__name__
            raise SystemExit(f"error: {flag}: its experts ({name}) {gap}; train it with chapter 04")
    for module in layers:
        experts = module.num_experts
        if experts == 1:
            raise SystemExit(
                f"error: {flag} has one expert per layer, none to split: train it with chapter 04"
            )
        top_k = getattr(model.config.get_text_config(), "num_experts_per_tok", None)
        if isinstance(top_k, int) and not 1 <= top_k <= experts:
            raise SystemExit(
                f"error: {flag}: its config's num_experts_per_tok ({top_k}) must be from 1 to its "
                f"{experts} experts per layer: fix it in the model's config.json"
            )
        if experts % args.ep_size:
            raise SystemExit(
                f"error: --ep-size {args.ep_size} must divide the model's {experts} experts per "
                f"layer: pass a divisor of both, such as {math.gcd(experts, args.ep_size)}"
            )
        step = GROUPED_MM_ALIGNMENT // dtype.itemsize
        widths = {width for param in module.parameters(recurse=False) for width in param.shape[1:]}
        # The config's private _experts_implementation, checked on transformers 5.0-5.24. If it
        # moves: no error here, but widths grouped_mm refuses fail at the first step: read
        # model.get_experts_implementation()[""] (transformers 5.17 and later).
        grouped = getattr(model.config, "_experts_implementation", None) == "grouped_mm"
        if grouped and any(width % step for width in widths):
            raise SystemExit(
                f"error: {flag}: its experts' widths {sorted(widths)} are not all multiples of "
                f"{step} ({GROUPED_MM_ALIGNMENT} bytes in {dtype}), which grouped_mm needs: use a "
                "model whose hidden and expert sizes are"
            )
    check_balancing(model, args, flag)
    return layers


def unstacked(module: nn.Module) -> str | None:
    """Why the module's experts are not transformers 5's stacked experts, or None: each weight its
    own (no nested modules), of shape (experts, ...)."""
    experts, weights = getattr(module, "num_experts", None), list(module.named_parameters())
    nested = [name for name, _ in weights if "." in name]
    odd = [f"{name} {tuple(p.shape)}" for name, p in weights if p.ndim < 2 or p.shape[0] != experts]
    if not nested and isinstance(experts, int) and not odd:
        return None
    why = ", ".join([f"num_experts {experts}", *odd[:1]])
    if nested:
        why = f"weights in nested modules ({nested[0]}...)"
    return (
        "are not transformers 5's stacked experts, each weight of shape (experts, ...) on one "
        f"module ({why})"
    )


def uncalled(module: nn.Module) -> str | None:
    """Why the module's experts are not called with the router's choices as transformers 5's are,
    or None."""
    called = inspect.signature(module.forward).parameters.values()
    if sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in called) < 3:
        signature = f"forward({', '.join(p.name for p in called)})"
        return (
            f"are called with the tokens alone, {signature}, not with the router's choices "
            "(transformers 5's forward(hidden_states, top_k_index, top_k_weights)) that this "
            "chapter sends each token by"
        )
    return None


def check_balancing(model: nn.Module, args, flag: str) -> None:
    """Refuses a balancing flag that the family cannot take: a loss its forward does not compute, a
    loss weighing more than the model's own, routing biases its routers do not carry."""
    coef, config = args.aux_loss_coef, model.config.get_text_config()
    if coef and not hasattr(config, "router_aux_loss_coef"):
        raise SystemExit(
            f"error: --aux-loss-coef {coef}: {flag} computes no balancing loss (its config has no "
            "router_aux_loss_coef); pass 0, or balance its routing biases with --bias-update-rate"
        )
    # PreTrainedModel's private _can_record_outputs, checked on transformers 5.0-5.24. If it moves:
    # every mixture of experts is refused with --aux-loss-coef above 0 ("collects no router
    # logits"): read what transformers then records outputs by.
    recorded = [getattr(m, "_can_record_outputs", None) or {} for m in model.modules()]
    on = getattr(config, "router_aux_loss_coef", 0) if coef is None else coef
    if on and not any("router_logits" in names for names in recorded):  # GraniteMoE in 5.17
        raise SystemExit(
            f"error: --aux-loss-coef {on} (default: the config's): {flag}'s forward collects no "
            f"router logits in transformers {transformers.__version__}, and so cannot compute its "
            "balancing loss: pass --aux-loss-coef 0 (chapter 04's way), or a newer transformers"
        )
    if coef is not None and coef > MAX_AUX_LOSS_COEF:
        raise SystemExit(
            f"error: --aux-loss-coef {coef} would weigh the routers' balancing loss over the "
            "model's own (published models weigh it 0.001 to 0.02), and overflow its gradients: "
            f"pass at most {MAX_AUX_LOSS_COEF}"
        )
    if args.bias_update_rate and not any(routing_biases(model, common.experts_modules(model))):
        raise SystemExit(
            f"error: --bias-update-rate {args.bias_update_rate}: {flag}'s routers carry no "
            f"routing bias (DeepSeek-V3's {ROUTING_BIASES[0]}) to move; pass 0, or balance it with "
            "--aux-loss-coef"
        )


def apply_expert_parallel(moe_layers, ep_mesh):
    """Each layer's experts split over the ep ranks: every weight's dim 0 (experts) a DTensor
    sharded on the ep mesh, so that checkpoints keep chapter 04's names and full shapes. The
    module's forward becomes dispatch(), which sends the tokens to their experts' ranks and runs
    HF's forward there on the rank's E / ep experts: replaced on the module, as transformers' own
    expert parallel does, which keeps its class, names and attributes for the MoE block's code (a
    hook cannot skip HF's forward over all E; a wrapper module would be another class)."""
    group = ep_mesh.get_group()
    for experts_module in moe_layers:
        for name, param in experts_module.named_parameters(recurse=False):
            sharded = distribute_tensor(param, ep_mesh, [Shard(0)], src_data_rank=None)
            experts_module.register_parameter(name, nn.Parameter(sharded))
        forward = functools.partial(dispatch, experts_module, experts_module.forward, group)
        experts_module.forward = torch.compiler.disable(forward)  # sizes known at run time: eager


def dispatch(experts_module, local_forward, group, hidden_states, top_k_index, top_k_weights):
    """Every rank calls this: the experts' forward under EP, as torchtitan's token dispatcher and
    transformers' AllToAllEP do it: each token's top-k copies go to the ranks holding their experts,
    are computed there and come back, weighed by the router's gates. Autograd's all-to-all sends
    their gradients back over the reversed splits."""
    ep_size, top_k = group.size(), top_k_index.shape[-1]
    # 1. The copies sorted by expert: a rank's experts are consecutive, so sorted by rank too.
    expert_ids = top_k_index.flatten()
    order = expert_ids.argsort(stable=True)
    send_counts = expert_ids.new_zeros(experts_module.num_experts)
    send_counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))  # copies per expert
    # 2. The counts exchanged: how many copies each rank receives for each of its experts. The split
    # sizes are read on the host (a GPU sync per layer, as in every EP with uneven splits).
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.view(ep_size, -1).sum(1).tolist()
    recv_splits = recv_counts.view(ep_size, -1).sum(1).tolist()
    # 3. The copies to their experts' ranks, grouped by sender, then by expert.
    sent = hidden_states[order // top_k]
    received = funcol.all_to_all_single_autograd(sent, recv_splits, send_splits, group)
    num_local = experts_module.num_experts // ep_size
    local_ids = torch.arange(num_local, device=received.device).repeat(ep_size)
    local_ids = local_ids.repeat_interleave(recv_counts, output_size=sum(recv_splits))
    # 4. The local experts, each copy on one expert at weight 1 (the gates are applied back home).
    # A rank that received nothing runs them on one zero row, sliced away: grouped_mm's backward
    # refuses 0 rows, and its experts then have gradients (zeros) for FSDP to reduce-scatter. The
    # row is the sum of the none received: backward still reaches this rank's all-to-all, which
    # every rank of the group must join.
    rows, ids = received, local_ids
    if not len(local_ids):
        rows, ids = received.sum(0, keepdim=True), local_ids.new_zeros(1)
    with local_experts(experts_module, num_local):
        computed = local_forward(rows, ids[:, None], rows.new_ones(len(ids), 1))
    computed = computed[: len(local_ids)]
    # 5. Back to the senders, in the copies' first order, weighed by the gates and summed per token.
    returned = funcol.all_to_all_single_autograd(computed, send_splits, recv_splits, group)
    outputs = returned[order.argsort()].view(*top_k_weights.shape, -1)
    return (outputs * top_k_weights[..., None]).sum(1).to(hidden_states.dtype)


@contextlib.contextmanager
def local_experts(experts_module, num_local):
    """The module as this rank's experts, for HF's forward: its weights their DTensors' local
    shards, its count E / ep; then put back. Through `_parameters`, as transformers' own expert
    parallel does (_use_local_dtensor_params): register_parameter refuses the weights FSDP gathers
    (not leaves), and a copy of the module to call instead would run its hooks twice."""
    sharded = dict(experts_module.named_parameters(recurse=False))
    num_experts = experts_module.num_experts
    # Module's private _parameters, checked on torch 2.11-2.14. If it moves: chapter 09 fails at its
    # first step in local_experts: swap the weights as FSDP2's fully_shard then does.
    experts_module._parameters.update({name: param.to_local() for name, param in sharded.items()})
    experts_module.num_experts = num_local
    try:
        yield
    finally:
        experts_module._parameters.update(sharded)
        experts_module.num_experts = num_experts


def clip_grad_norm_(parameters, max_norm: float, pp_group) -> torch.Tensor:
    """Every rank calls this: torch's clip_grad_norm_, over gradients on two meshes (the dense one
    and the experts'), which it refuses ("must have the same mesh"): the norm of each mesh's
    gradients, combined, and over every pipeline stage's (`pp_group`); then each scaled."""
    by_mesh = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh, []).append(param)
    grads = [[param.grad for param in params] for params in by_mesh.values()]
    norms = [torch.nn.utils.get_total_norm(mesh_grads).full_tensor() for mesh_grads in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms)) ** 2
    dist.all_reduce(total_norm, group=pp_group)  # the other stages' gradients: their squares summed
    total_norm = total_norm.sqrt()
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


def routing_biases(model: nn.Module, layers: list[nn.Module]) -> list[tuple | None]:
    """Where each experts module's routing bias lives, as (owner, name), or None: the bias that
    DeepSeek-V3's routers (and GLM-4.5's, dots1's, ERNIE 4.5's, MiniMax-M2's...) add to their
    scores to choose the top k experts, not to weigh them; beside the experts, in the router or the
    MoE block, a buffer or a frozen parameter. Found by name: FSDP and the chapter replace it."""
    parents = {module: name.rpartition(".")[0] for name, module in model.named_modules()}
    found = []
    for module in layers:
        block = model.get_submodule(parents[module])  # the experts' parent: the MoE block
        tensors = [name for name, _ in [*block.named_buffers(), *block.named_parameters()]]
        names = [n for n in tensors if n.endswith(ROUTING_BIASES) and not n.startswith("experts.")]
        owner, _, attribute = names[0].rpartition(".") if names else ("", "", None)
        found.append((block.get_submodule(owner), attribute) if names else None)
    return found


def track_load(model: nn.Module, layers: list[nn.Module], rate: float | None) -> None:
    """Each experts module's load: a forward pre-hook adds the tokens its router sent to each expert
    to `module.load`, on this rank, at each training call (not evaluation's), until update_load
    reads it after the step: every micro-batch's, however a pipeline orders them. Activation
    checkpointing's recompute calls the experts again and counts them twice, as torchtitan's do:
    the update reads only signs, the log only ratios, which the double leaves as they are. And
    DeepSeek-V3's balancing where the routers carry its routing biases (routing_biases): each moved
    by `rate` per step (None: BIAS_UPDATE_RATE; 0: frozen)."""

    def count(module, inputs):
        if torch.is_grad_enabled():  # training: forward, and recompute in backward
            top_k_index = inputs[1].flatten()
            tokens = top_k_index.new_zeros(module.num_experts)
            module.load = module.load + tokens.scatter_add_(0, top_k_index, torch.ones_like(top_k_index))

    rate = BIAS_UPDATE_RATE if rate is None else rate
    for index, (module, bias) in enumerate(zip(layers, routing_biases(model, layers))):
        module.layer_index = index  # among the model's layers of experts (a stage holds some)
        module.register_forward_pre_hook(torch.compiler.disable(count))
        module.load, module.load_since_log = 0, 0
        module.routing_bias, module.bias_update_rate = bias if rate else None, rate
    if any(module.routing_bias for module in layers):
        logger.info(f"The routers' routing biases moved toward even loads by {rate} per step")


def update_load(layers: list[nn.Module], group=None) -> None:
    """Every rank calls this: after each optimizer step: the step's load (layers, experts) summed
    over all ranks (each counted the tokens it sent), kept for the log line; and DeepSeek-V3's
    auxiliary-loss-free balancing: each layer's routing bias moved toward even loads, up by the
    rate for the experts below the mean load, down for those above (torchtitan's update: the sign
    of each one's deficit, centred). Every rank moves it the same, from the same counts. With
    pipeline stages, summed over `group`: the ranks that hold the same layers."""
    if not layers:  # a stage with none: nor have the others of its group
        return
    step_load = torch.stack([module.load for module in layers]).float()
    dist.all_reduce(step_load, group=group)
    for module, load in zip(layers, step_load):
        module.load, module.load_since_log = 0, module.load_since_log + load
        if module.routing_bias:
            owner, name = module.routing_bias
            bias = getattr(owner, name)
            delta = module.bias_update_rate * torch.sign(load.mean() - load)
            delta = (delta - delta.mean()).view(bias.shape).to(bias.dtype)
            if isinstance(bias, DTensor):  # a frozen parameter that FSDP shards: this rank's part
                mesh, placements = bias.device_mesh, bias.placements
                delta = distribute_tensor(delta, mesh, placements, src_data_rank=None)
            with torch.no_grad():
                bias.add_(delta)


def load_metrics(layers: list[nn.Module], pp_group) -> dict:
    """Every rank calls this (an all-gather of every stage's layers over `pp_group`): each layer's
    tokens per expert since the last log, over all ranks: the busiest expert against the mean, per
    layer and the worst. An expert twice as busy as the mean takes twice as long, and all ranks
    wait for it; summed by update_load, reset here."""
    ratios = {}
    if layers:  # a pipeline stage may hold none
        counts = torch.stack([module.load_since_log for module in layers])  # (layers, experts)
        busiest = (counts.max(dim=1).values / counts.mean(dim=1)).tolist()
        ratios = {module.layer_index: ratio for module, ratio in zip(layers, busiest)}
    for module in layers:
        module.load_since_log = 0
    every = [None] * pp_group.size()
    dist.all_gather_object(every, ratios, group=pp_group)
    ratios = {index: ratio for stage in every for index, ratio in stage.items()}
    per_layer = {f"experts/load_layer_{i}": ratios[i] for i in sorted(ratios)}
    return {"experts/load": max(ratios.values()), **per_layer}


def compilable(block, args) -> bool:
    """Whether torch.compile can take the block: not a MoE block under TP. On torch 2.13 its graphs,
    which stop at the dispatch, fail once evaluation calls them ("'Tensor' object has no attribute
    'elem'": AOT autograd's wrapper expects the AsyncCollectiveTensor that TP's collectives left in
    the hidden states it traced), and its attention compiled alone fails to find TP's group: such a
    block runs eager, said once."""
    moe_under_tp = bool(common.experts_modules(block)) and args.tp_size > 1
    if moe_under_tp and not getattr(compilable, "said", False):
        compilable.said = True
        logger.info("--compile: the blocks of experts under --tp-size run eager (experts.compilable)")
    return not moe_under_tp


def reduce_expert_grads(model, moe_layers: list, dims) -> None:
    """Every rank calls this (all-reduces over tp), after backward: the gradients of a mixture of
    experts' parts that each tp rank keeps whole (router, shared experts), each from its own tokens,
    summed over tp, as DTensor sums a sequence-parallel norm's; the experts', which the tokens of
    the ep ranks summed into and FSDP averaged over efsdp (dp_shard x cp x tp / ep ranks), times tp
    / ep: both then the mean over the dp ranks, as the dense gradients are (FSDP's over dp_shard x
    cp, TP's sum over tp)."""
    experts_params = {param for layer in moe_layers for param in layer.parameters()}
    for param in experts_params:
        param.grad.mul_(dims.tp / dims.ep)
    if dims.tp == 1:
        return
    parents = {module: name.rpartition(".")[0] for name, module in model.named_modules()}
    for layer in moe_layers:
        for param in model.get_submodule(parents[layer]).parameters():
            if param not in experts_params:  # FSDP's shard of it: the same on every tp rank
                dist.all_reduce(param.grad.to_local(), group=dims.tp_mesh.get_group())

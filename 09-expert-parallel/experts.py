"""The checks and the bookkeeping around expert parallelism, beside the chapter: which layers are a
mixture of experts, what --ep-size the ranks and the experts can take, the gradient norm over two
meshes, and the experts' load. The dispatch itself, the experts' mesh and their sharding are the
chapter's (train_llm.py).

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

import logging
import math

import torch
import torch.distributed as dist
from torch import nn

# The norm of the experts' gradients, on their 2-D (efsdp, ep) mesh, is two all-reduces of one
# number each; DTensor warns at every step that one would do (on a flattened mesh). Not worth a
# flattened mesh.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

# grouped_mm on the CPU reads its operands in 16-byte steps: every width of an expert's weights must
# be a multiple of 16 bytes (4 fp32 numbers). GPUs ask the same of bf16 (8 numbers).
GROUPED_MM_ALIGNMENT = 16


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """The modules holding stacked experts: `experts` children counting `num_experts`, in order."""
    modules = model.named_modules()
    return [m for name, m in modules if name.endswith(".experts") and hasattr(m, "num_experts")]


def check_layout(args, world_size: int, shard_size: int) -> None:
    """Refuses an --ep-size that the ranks cannot take (the experts' count: with the model)."""
    if shard_size % args.ep_size:
        which = "--shard-size" if shard_size != world_size else "all ranks"
        raise SystemExit(
            f"error: --ep-size {args.ep_size} must divide the ranks that shard the model "
            f"({shard_size}: {which}): pass a divisor, such as {math.gcd(shard_size, args.ep_size)}"
        )


def check_model(model: nn.Module, args, dtype: torch.dtype) -> list[nn.Module]:
    """The model's experts modules, or one line where expert parallelism cannot take them."""
    flag = f"--model-name {model.config.name_or_path!r}"
    names = ("num_experts", "num_local_experts", "n_routed_experts")
    counts = [getattr(model.config, name, None) for name in names]
    if not any(isinstance(count, int) and count > 1 for count in counts):
        raise SystemExit(
            f"error: {flag} is a dense model (no layer of routed experts): expert parallelism "
            "needs a mixture of experts (Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3...); train a dense "
            "model with chapter 04"
        )
    layers = experts_modules(model)
    def stacked(module):  # every weight its own, each of shape (experts, ...)
        weights = list(module.parameters(recurse=False))
        nested = any(list(child.parameters()) for child in module.children())
        return not nested and all(p.ndim >= 2 and p.shape[0] == module.num_experts for p in weights)

    odd = [module for module in layers if not stacked(module)]
    if not layers or odd:
        raise SystemExit(
            f"error: {flag}: its experts are not transformers 5's stacked experts (every weight "
            "of shape (experts, ...) on one `experts` module, called with the router's top-k "
            "choices): this chapter cannot place them; train it with chapter 04"
        )
    for module in layers:
        if module.num_experts % args.ep_size:
            raise SystemExit(
                f"error: --ep-size {args.ep_size} must divide the model's {module.num_experts} "
                f"experts per layer: pass a divisor of {module.num_experts}"
            )
        step = GROUPED_MM_ALIGNMENT // dtype.itemsize
        widths = {width for param in module.parameters(recurse=False) for width in param.shape[1:]}
        grouped = getattr(model.config, "_experts_implementation", None) == "grouped_mm"
        if grouped and any(width % step for width in widths):
            raise SystemExit(
                f"error: {flag}: its experts' widths {sorted(widths)} are not all multiples of "
                f"{step} ({GROUPED_MM_ALIGNMENT} bytes in {dtype}), which grouped_mm needs: use a "
                "model whose hidden and expert sizes are"
            )
    return layers


def set_balancing_loss(config, args) -> None:
    """The routers' load-balancing loss (Switch Transformer's: experts' token shares times their
    mean router probabilities), which HF adds to the loss, times --aux-loss-coef (default: the
    config's), only when the config asks for the router logits. Published configs (Qwen3-MoE's,
    Mixtral's) do not, as HF's Trainer trains them; chapter 04 follows the config. Here it is on: a
    router left alone may send most tokens to a few experts, and under EP their ranks then set
    everyone's pace. Its logits are collected by hooks that dynamo cannot trace inside a block,
    which chapter 04 compiles whole and this chapter does not."""
    coef = config.router_aux_loss_coef if args.aux_loss_coef is None else args.aux_loss_coef
    config.output_router_logits, config.router_aux_loss_coef = coef > 0, coef


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, over gradients on two meshes (the dense one and the experts'), which
    it refuses ("must have the same mesh"): the norm of each mesh's gradients, combined; then each
    scaled."""
    by_mesh = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(param.grad.device_mesh, []).append(param)
    grads = [[param.grad for param in params] for params in by_mesh.values()]
    norms = [torch.nn.utils.get_total_norm(mesh_grads).full_tensor() for mesh_grads in grads]
    total_norm = torch.linalg.vector_norm(torch.stack(norms))
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total_norm)
    return total_norm


def load_metrics(layers: list[nn.Module]) -> dict:
    """Each layer's tokens per expert since the last log, over all ranks: the busiest expert against
    the mean, per layer and the worst. An expert twice as busy as the mean takes twice as long, and
    all ranks wait for it; counted by the dispatch (`experts.load`), reset here."""
    counts = torch.stack([module.load for module in layers]).float()  # (layers, experts)
    dist.all_reduce(counts)  # each rank counted the tokens it sent
    ratios = (counts.max(dim=1).values / counts.mean(dim=1)).tolist()
    for module in layers:
        module.load = 0
    per_layer = {f"experts/load_layer_{i}": ratio for i, ratio in enumerate(ratios)}
    return {"experts/load": max(ratios), **per_layer}

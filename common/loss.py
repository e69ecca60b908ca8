"""The step's loss as the mean over the tokens it trains, at every layout. Rows train different
numbers of tokens (a conversation's prompt and padding are not trained), so a mean of each
micro-batch's and each rank's mean is not the step's mean: each micro-batch's summed cross-entropy
is divided by one count of the whole step's trained tokens instead (transformers' own fix, its
`num_items_in_batch`)."""

import torch
import torch.distributed as dist


def num_items_in_batch(batches, device) -> torch.Tensor:
    """The trained tokens of `batches` (labels other than -100, after the shift to next tokens), on
    `device`, never 0 (a loss over no tokens is 0, not NaN). Counted in tensors on the host, where
    the rows are before they are copied, and copied as they are: the host never waits for the
    device, as a Python number made a tensor would have it wait."""
    count = torch.stack([(batch["labels"][:, 1:] != -100).sum() for batch in batches]).sum().clamp(min=1)
    if device.type == "cuda":
        count = count.pin_memory()
    return count.to(device, non_blocking=True)


def all_reduce_mean(value: torch.Tensor) -> torch.Tensor:
    """Every rank calls this: the mean of `value` over the world's ranks (a new tensor). Of the
    ranks' counts (`num_items_in_batch`), the job's count per rank: each rank divides its loss's
    sum by it, and the data-parallel mean of the gradients (DDP's, FSDP's) makes the sum over all
    tokens over their count. A rank that holds a copy of another's tokens (tensor parallel, a
    pipeline's other stages) counts them, and is counted among the ranks: every layout, one rule."""
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()

"""Selective activation checkpointing: the attention kernel's outputs kept, everything else of a layer recomputed.

With activation checkpointing each decoder layer runs its forward twice; on long rows most of that forward is the
attention kernel (its work grows with the row's length, the rest of the layer's does not), so recomputing it is most
of checkpointing's cost there. Keeping the kernel's outputs (the attention output and its log-sum-exp, one
[tokens x heads x head_dim] tensor and a small one per layer, `sft.plan.memory` counts them) lets the recomputation
skip the kernel: the backward gets them from the forward, and recomputes only the projections, norms, RoPE and MLP.

PyTorch does the selecting (`torch.utils.checkpoint.create_selective_checkpoint_contexts`, the `context_fn` of the
non-reentrant checkpoint, as torchtitan's `op` policy does); transformers' checkpointing passes it on
(`activation_checkpointing_enable`). sft names the operators: PyTorch's varlen FlashAttention-2 (`sft_varlen`) and
sdpa's kernels. A backend outside them (flex attention, an extension's kernel) is recomputed as before, which is
correct, and logged.

With the checkpoints offloaded, `expandable_segments` turns on PyTorch's expandable segments for the rest of the run.
"""

from __future__ import annotations

import functools
import os

import torch

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"


def attention_ops() -> set:
    """The attention kernels whose outputs are kept: those of this PyTorch build."""
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
             "_flash_attention_forward", "_efficient_attention_forward")  # fmt: skip
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    varlen = getattr(getattr(torch.ops, "torch_attn", None), "_varlen_attn", None)
    if varlen is not None:
        ops.add(varlen.default)
    return ops


def _policy(ops, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


def context_fn():
    """The checkpoint's `context_fn`: a fresh pair of selective-checkpoint contexts per checkpointed call."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(functools.partial(_policy, attention_ops()))


def keep_attention_outputs(model: torch.nn.Module, kwargs: dict | None = None) -> None:
    """Checkpoint `model`'s decoder layers (as transformers' `activation_checkpointing_enable`, with its other
    `kwargs`) keeping the attention kernels' outputs; the non-reentrant checkpoint, which selective checkpointing
    needs."""
    kwargs = {k: v for k, v in (kwargs or {}).items() if k not in ("offload", "every_n_layers")}
    model.activation_checkpointing_enable(
        activation_checkpointing_kwargs={**kwargs, "use_reentrant": False, "context_fn": context_fn}
    )


def expandable_segments() -> bool:
    """With the checkpoints offloaded (the longest rows), PyTorch's caching allocator in expandable segments from here
    on, unless `PYTORCH_CUDA_ALLOC_CONF` says how to allocate. Without them a long row's blocks of many sizes leave
    memory that is reserved but not allocated: on 1 x H100 capped at 12 GiB, Qwen3-4B at 52,224 and 57,344 tokens
    ran out of memory with 9.0-9.6 GiB allocated and 2.0-2.6 GiB reserved but unallocated, as did Llama-3.2-3B at
    120,832 (8.7 and 3.2; benchmarks/results/long_context_1gpu, calls 9 and 10), where the plan, which counts
    allocated memory, had them under the 12 GiB. True if it turned them on."""
    if os.environ.get(ALLOC_CONF_ENV) or not torch.cuda.is_available():
        return False
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.10; before, torch.cuda's
    (set_settings or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")
    return True

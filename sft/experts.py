"""The experts of a mixture-of-experts layer: sft's implementation, registered in transformers' `ExpertsInterface`.

transformers 5.x runs a MoE layer's experts as two grouped GEMMs (`experts_implementation="grouped_mm"`), and around
them: each token copied to its k expert slots by advanced indexing (whose backward is an atomic scatter-add), the
SwiGLU gate on the two strided halves of the up projection (non-vectorized kernels, three tensors kept for the
backward), the routing weights multiplied in and the k outputs put back in token order by another advanced index
(a second scatter-add in the backward) and summed. On one H100 at Qwen3-30B-A3B's widths those kernels took more of a
step than the grouped GEMMs themselves (benchmarks/results/profile_step_qwen3_moe_h100: 0.21 s elementwise, 0.18 s
matmul of a 0.65 s step).

`sft_grouped` keeps transformers' grouped GEMMs (`transformers.integrations.moe._grouped_linear`, the same kernels and
layouts) and replaces what is around them:

- **dispatch** (`_Dispatch`): the token copies are one row gather; the backward gathers each token's k gradient rows
  by the inverse permutation and sums them (no atomics: deterministic, one fp32-accumulated sum per token);
- **gate**: on a GPU, SiLU(gate) x up as one compiled pointwise kernel reading the strided halves, whose backward
  writes the gradient of the whole up projection at once and keeps only its input; elsewhere, and for a family with
  its own gate (gpt-oss's clamped SwiGLU), the model's `_apply_gate`;
- **combine** (`_Combine`): the k outputs of a token gathered and weighted by one batched product (fp32 accumulation);
  the backward is two gathers and a batched product, no scatter.

The arithmetic is the same as transformers' (tests/test_experts.py: every token's output and every gradient equal to
the per-expert loop within 1e-5 in fp32, for each MoE family transformers ships). Which families use it by default is
decided by measurement (`sft.architectures.KERNELS["experts"]`, benchmarks/profile_step.py); elsewhere transformers'
choice stays, with the reason logged. A user's `model_init_kwargs: {experts_implementation: ...}` is always kept.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from transformers.integrations import moe as hf_moe

logger = logging.getLogger(__name__)

NAME = "sft_grouped"


class _Dispatch(torch.autograd.Function):
    """Rows of `x` in expert order: row s is token `token[s]`. Backward: a token's gradient is the sum of its k rows,
    found by the inverse permutation (`inverse[t * k + j]` is the row of the token's j-th choice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, token: torch.Tensor, inverse: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        rows = grad.index_select(0, inverse)
        return rows.view(-1, ctx.k, grad.size(-1)).sum(dim=1), None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] x y[inverse[t * k + j]]: the expert outputs `y` (expert order) back in token order,
    weighted and summed in one batched product. The backward recomputes the gather instead of keeping it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, inverse: torch.Tensor, token: torch.Tensor, perm):
        tokens, k = weights.shape
        dtype = torch.promote_types(y.dtype, weights.dtype)  # as transformers' product: fp32 weights give fp32 sums
        gathered = y.index_select(0, inverse).view(tokens, k, y.size(-1)).to(dtype)
        out = torch.bmm(weights.to(dtype).unsqueeze(1), gathered).squeeze(1)
        ctx.save_for_backward(y, weights, inverse, token, perm)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, weights, inverse, token, perm = ctx.saved_tensors
        tokens, k = weights.shape
        grad = grad.contiguous()
        grad_weights = None
        if ctx.needs_input_grad[1]:
            gathered = y.index_select(0, inverse).view(tokens, k, y.size(-1)).to(grad.dtype)
            grad_weights = torch.bmm(gathered, grad.unsqueeze(-1)).squeeze(-1).to(weights.dtype)
        grad_y = None
        if ctx.needs_input_grad[0]:
            scale = weights.reshape(-1).index_select(0, perm).to(grad.dtype)
            grad_y = (grad.index_select(0, token) * scale.unsqueeze(-1)).to(y.dtype)
        return grad_y, grad_weights, None, None, None


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@functools.cache
def _compiled_swiglu():
    return torch.compile(_swiglu, dynamic=True)


def _gate(module: torch.nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    default = type(module)._apply_gate is hf_moe._default_apply_gate
    if default and gate_up.is_cuda and isinstance(module.act_fn, torch.nn.SiLU):
        return _compiled_swiglu()(gate_up)
    return module._apply_gate(gate_up)


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Drop-in for transformers' `grouped_mm_experts_forward` (same arguments, same result)."""
    if self._is_expert_parallel or self.has_post_expert_norm:  # transformers' own path for what it alone handles
        return hf_moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    k = top_k_index.size(-1)
    expert_ids = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(expert_ids, stable=True)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    token = perm // k
    # each expert's end row: a search in the sorted ids (no histogram: deterministic, and no wait for the host)
    offsets = torch.searchsorted(sorted_ids, torch.arange(self.num_experts, device=perm.device), right=True,
                                 out_int32=True)  # fmt: skip

    rows = _Dispatch.apply(hidden_states, token, inverse, k)
    first = self.gate_up_proj if self.has_gate else self.up_proj
    bias = None
    if self.has_bias:
        bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias).index_select(0, sorted_ids)
    h = hf_moe._grouped_linear(rows, first, offsets, bias=bias, is_transposed=self.is_transposed)
    h = _gate(self, h) if self.has_gate else self.act_fn(h)
    bias = self.down_proj_bias.index_select(0, sorted_ids) if self.has_bias else None
    y = hf_moe._grouped_linear(h, self.down_proj, offsets, bias=bias, is_transposed=self.is_transposed)
    out = _Combine.apply(y, top_k_weights, inverse, token, perm)
    return out.to(hidden_states.dtype)


hf_moe.ExpertsInterface.register(NAME, experts_forward)


def decide(arch, model_init_kwargs: dict | None):
    """Which experts implementation a MoE model trains with, and why: the user's `experts_implementation` in
    `model_init_kwargs` if given; else sft's where `sft.architectures.KERNELS` has it measured faster for the family;
    else transformers' default (`grouped_mm`). Returns (name or None for transformers' default, reason)."""
    asked = (model_init_kwargs or {}).get("experts_implementation")
    if asked:
        return asked, f"model_init_kwargs.experts_implementation: {asked}"
    kernel = arch.kernel("experts")
    if kernel.on:
        return NAME, kernel.reason
    return None, f"transformers' grouped_mm ({kernel.reason})"


def apply(model: torch.nn.Module, name: str | None) -> None:
    """Switch a built model's experts to `name` (None: leave transformers' choice)."""
    if name is None or name == getattr(model.config, "_experts_implementation", None):
        return
    model.set_experts_implementation(name)

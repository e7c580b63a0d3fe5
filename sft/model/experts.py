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

`sft_grouped_fp8` runs the two grouped GEMMs through torchao's float8 rowwise grouped GEMM, each expert's rows padded
to a multiple of 16 with zero rows (`layout(..., align=16)`).

The arithmetic is the same as transformers' (tests/test_experts.py: every token's output and every gradient equal to
the per-expert loop within 1e-5 in fp32, for each MoE family transformers ships, aligned or not). Measured on 1 x H100
(benchmarks/results/moe_h100): one layer 1.04-1.11x transformers' grouped_mm, the whole eager model 1.02-1.03x, equal
inside compiled decoder layers (which fuse transformers' elementwise work themselves); the float8 variant 0.75x. Which
families use it by default is decided by those measurements (`sft.model.architectures.KERNELS["experts"]`); elsewhere
transformers' choice stays, with the reason logged. A user's `model_init_kwargs: {experts_implementation: ...}` is
always kept.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.integrations import moe as hf_moe

NAME = "sft_grouped"
NAME_FP8 = "sft_grouped_fp8"  # its grouped GEMMs in torchao's float8 (rowwise scales; CUDA)


class Layout(NamedTuple):
    """Where each (token, choice) slot sits in the experts' rows. Rows are grouped by expert (`offsets`: each group's
    end); with `align` > 1 every group is padded with zero rows to a multiple of `align` (float8 grouped GEMMs need
    16) and the last group runs to the end of a fixed number of rows (no size that only the GPU knows)."""

    row_token: torch.Tensor  # per row: its token, or `tokens` (a zero row) for padding
    slot_row: torch.Tensor  # per slot t * k + j: its row
    row_slot: torch.Tensor  # per row: its slot, or `slots` (a zero weight) for padding
    offsets: torch.Tensor  # int32, per expert: the end of its rows

    def row_expert(self) -> torch.Tensor:
        """Per row: its expert (for per-expert biases)."""
        rows = torch.arange(self.row_token.numel(), dtype=self.offsets.dtype, device=self.offsets.device)
        return torch.searchsorted(self.offsets, rows, right=True).clamp_(max=self.offsets.numel() - 1)


def layout(top_k_index: torch.Tensor, num_experts: int, align: int = 1) -> Layout:
    tokens, k = top_k_index.shape
    slots = tokens * k
    device = top_k_index.device
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    # each expert's end: a search in the sorted ids (no histogram: deterministic, and no wait for the host)
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=device), right=True)
    if align == 1:
        rows, sorted_row, offsets = slots, torch.arange(slots, device=device), ends
    else:
        counts = torch.diff(ends, prepend=ends.new_zeros(1))
        padded = (counts + align - 1) // align * align
        padded_ends = torch.cumsum(padded, 0)
        rows = (slots + align - 1) // align * align + align * num_experts
        sorted_row = torch.arange(slots, device=device) + (padded_ends - padded - ends + counts)[sorted_ids]
        offsets = torch.cat([padded_ends[:-1], padded_ends.new_full((1,), rows)])
    row_token = torch.full((rows,), tokens, dtype=perm.dtype, device=device)
    row_token[sorted_row] = perm // k
    row_slot = torch.full((rows,), slots, dtype=perm.dtype, device=device)
    row_slot[sorted_row] = perm
    slot_row = torch.empty_like(perm)
    slot_row[perm] = sorted_row
    return Layout(row_token, slot_row, row_slot, offsets.to(torch.int32))


def _with_zero_row(x: torch.Tensor, needed: bool) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])]) if needed else x


class _Dispatch(torch.autograd.Function):
    """The experts' rows: row r is token `row_token[r]` (a zero row for padding). Backward: a token's gradient is the
    sum of its k rows, found by `slot_row` (slot t * k + j is the token's j-th choice): gathers, no scatter-add."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, row_token: torch.Tensor, slot_row: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(slot_row)
        ctx.k = k
        return _with_zero_row(x, row_token.numel() > slot_row.numel()).index_select(0, row_token)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (slot_row,) = ctx.saved_tensors
        rows = grad.index_select(0, slot_row)
        return rows.view(-1, ctx.k, grad.size(-1)).sum(dim=1), None, None, None


class _Combine(torch.autograd.Function):
    """out[t] = sum_j weights[t, j] x y[slot_row[t * k + j]]: the expert outputs back in token order, weighted and
    summed in one batched product. The backward recomputes the gather instead of keeping it."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, row_token, slot_row, row_slot) -> torch.Tensor:
        tokens, k = weights.shape
        dtype = torch.promote_types(y.dtype, weights.dtype)  # as transformers' product: fp32 weights give fp32 sums
        gathered = y.index_select(0, slot_row).view(tokens, k, y.size(-1)).to(dtype)
        out = torch.bmm(weights.to(dtype).unsqueeze(1), gathered).squeeze(1)
        ctx.save_for_backward(y, weights, row_token, slot_row, row_slot)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, weights, row_token, slot_row, row_slot = ctx.saved_tensors
        tokens, k = weights.shape
        grad = grad.contiguous()
        grad_weights = None
        if ctx.needs_input_grad[1]:
            gathered = y.index_select(0, slot_row).view(tokens, k, y.size(-1)).to(grad.dtype)
            grad_weights = torch.bmm(gathered, grad.unsqueeze(-1)).squeeze(-1).to(weights.dtype)
        grad_y = None
        if ctx.needs_input_grad[0]:
            padded = row_token.numel() > slot_row.numel()
            scale = _with_zero_row(weights.reshape(-1, 1), padded).index_select(0, row_slot).to(grad.dtype)
            grad_y = (_with_zero_row(grad, padded).index_select(0, row_token) * scale).to(y.dtype)
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


def _linear(rows, weight, offsets, bias, transposed: bool, fp8: bool) -> torch.Tensor:
    """One grouped GEMM: transformers' (its kernels and layouts), or torchao's float8 rowwise-scaled one for experts
    stored (experts, out, in), whose transpose is the column-major operand it takes."""
    if not fp8:
        return hf_moe._grouped_linear(rows, weight, offsets, bias=bias, is_transposed=transposed)
    from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

    return _to_fp8_rowwise_then_scaled_grouped_mm(
        rows, weight.transpose(-2, -1), offsets, out_dtype=rows.dtype, pad_token_groups_for_grouped_mm=False
    )


def experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
    fp8: bool = False, align: int = 1,
) -> torch.Tensor:  # fmt: skip
    """Drop-in for transformers' `grouped_mm_experts_forward` (same arguments, same result); `fp8`: the grouped GEMMs
    in float8 (`NAME_FP8`, groups aligned to 16 rows); `align` alone pads the groups (for tests of that layout)."""
    fp8 = fp8 and not (self.is_transposed or self.has_bias)  # torchao's operand layout; no per-row bias
    if self._is_expert_parallel or self.has_post_expert_norm:  # transformers' own path for what it alone handles
        return hf_moe.grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    k = top_k_index.size(-1)
    where = layout(top_k_index, self.num_experts, 16 if fp8 else align)
    rows = _Dispatch.apply(hidden_states, where.row_token, where.slot_row, k)
    first = self.gate_up_proj if self.has_gate else self.up_proj
    row_expert = where.row_expert() if self.has_bias else None
    bias = None
    if self.has_bias:
        bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias).index_select(0, row_expert)
    h = _linear(rows, first, where.offsets, bias, self.is_transposed, fp8)
    h = _gate(self, h) if self.has_gate else self.act_fn(h)
    bias = self.down_proj_bias.index_select(0, row_expert) if self.has_bias else None
    y = _linear(h, self.down_proj, where.offsets, bias, self.is_transposed, fp8)
    out = _Combine.apply(y, top_k_weights, where.row_token, where.slot_row, where.row_slot)
    return out.to(hidden_states.dtype)


hf_moe.ExpertsInterface.register(NAME, experts_forward)
hf_moe.ExpertsInterface.register(NAME_FP8, functools.partial(experts_forward, fp8=True))


def decide(arch, model_init_kwargs: dict | None):
    """Which experts implementation a MoE model trains with, and why: the user's `experts_implementation` in
    `model_init_kwargs` if given; else sft's where `sft.model.architectures.KERNELS` has it measured faster for the
    family; else transformers' default (`grouped_mm`). Returns (name or None for transformers' default, reason)."""
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


class RouterLoad:
    """How evenly each MoE layer's router spreads tokens over its experts, for the training log: forward pre-hooks on
    the model's experts modules (transformers calls them `(hidden_states, <expert index per token and choice>,
    weights)`) add each training forward's choices into per-layer counts on the device (a scatter-add: no wait for the
    host); `summary` reads them once per log. Shares, not counts, so a layer recomputed by activation checkpointing
    (its choices counted twice, as every checkpointed layer's) reads the same; evaluation forwards are not counted."""

    def __init__(self, model: torch.nn.Module):
        from sft.model.architectures import experts_modules

        # not a rank's share of the experts (expert parallelism: the indices are global)
        self.layers = [m for m in experts_modules(model) if not getattr(m, "_is_expert_parallel", False)]
        self.counts: list[torch.Tensor | None] = [None] * len(self.layers)
        for i, module in enumerate(self.layers):
            module.register_forward_pre_hook(functools.partial(self._count, i))

    def _count(self, i: int, module: torch.nn.Module, args: tuple) -> None:
        index = args[1] if len(args) > 1 else None
        if not module.training or not torch.is_tensor(index) or index.is_floating_point() or index.dtype == torch.bool:
            return
        if self.counts[i] is None:
            self.counts[i] = torch.zeros(module.num_experts, dtype=torch.float32, device=index.device)
        flat = index.reshape(-1).long()
        self.counts[i].scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32))

    def summary(self, reduce=None) -> dict[str, float]:
        """Since the last summary: `router_load_max`, the busiest expert's share of its layer's choices over an even
        share (1.0: perfectly balanced; the largest over the layers), and `router_idle_experts`, the fraction of
        experts (over every layer) that no token chose; `reduce` (a sum over processes, in place) first. Empty where
        nothing was counted. Resets the counts."""
        counted = [c for c in self.counts if c is not None]
        if not counted:
            return {}
        if reduce is not None:  # one collective for every layer's counts
            joined = torch.cat(counted)
            reduce(joined)
            counted = list(joined.split([c.numel() for c in counted]))
        busiest = max(float(c.max() / c.sum().clamp_min(1) * c.numel()) for c in counted)
        idle = sum(int((c == 0).sum()) for c in counted) / sum(c.numel() for c in counted)
        self.counts = [None] * len(self.layers)
        return {"router_load_max": busiest, "router_idle_experts": idle}

"""Gated DeltaNet linear-attention layers (Qwen3-Next, Qwen3.5) over packed rows, each sample from a zero state.

A linear-attention layer carries a recurrent state along the sequence, and its short causal convolution a window of
the last tokens: over a packed row both must restart at every sample. transformers passes the boundaries to the fast
kernels (flash-linear-attention's `chunk_gated_delta_rule(cu_seqlens=...)`, `causal_conv1d`'s `seq_idx`) where they are
installed, refuses a packed row on its torch fallback ("can't keep packed sequences apart without causal_conv1d"), and
passes none to the torch convolution it falls back to. sft runs each layer's own forward once on the whole row with
the boundaries (`cu_seq_lens_q`), its projections and norm over every token, and gives the layer's module two kernels
that restart at each boundary:

- **varlen** (on a GPU with flash-linear-attention installed, `pip install 'sft[fla]'`, where fla can train): fla's
  `chunk_gated_delta_rule(cu_seqlens=...)` (transformers resolves it at import) and fla's
  `causal_conv1d(cu_seqlens=...)`. On an H200 under Triton 3.7.1 beside torch 2.11 (Qwen3.5 text widths, 4 layers,
  rows of 8,192; benchmarks/linear_attention.py, benchmarks/results/families_2026): every gradient within 0.067 of the
  fp32 per-sample path's (bf16 torch: 0.054), forward and backward 71,980 tokens/s against 32,057 batched and 22,886
  per sample. On a Hopper GPU under Triton 3.4-3.7.0 (torch 2.10-2.11's) fla refuses one of its backward kernels
  (fla issue #640); `sft.model.fla_hopper` gives fla that piece in torch, through fla's own backend registry (one
  H100, Triton 3.6: gradients within 0.079 of the fp32 per-sample path's, 57,442 tokens/s against 27,638 batched).
- **per sample** (anywhere else): transformers' torch convolution once per sample's slice from a zero-padded window,
  and its torch recurrence (`torch_chunk_gated_delta_rule`) from a zero state per sample, as the sample alone
  (tests/test_linear_attention.py: packed rows equal their samples one by one, gradients too). The recurrence takes
  the row's samples in groups of similar length (`groups`), each group one call with its samples as the batch,
  zero-padded at their ends to the group's longest (padding after a sample cannot reach it: the recurrence is causal),
  so that a row of many samples costs a few calls, not one per sample. That is exact (the tests; on an H200 in bf16
  every gradient within bf16's own noise of the fp32 per-sample path's, as the per-sample path's) and taken where the
  row is on a GPU: there it was faster (Qwen3.5 text widths, 4 layers, rows of 8,192: forward and backward 31,451
  tokens/s against 22,051, forward 127,532 against 84,163; benchmarks/results/families_2026/linear_attention.md),
  on the CPU not (the tests' widths, rows of 4,096: forward 4,626 against 5,790, with backward 1,426 against 1,440;
  benchmarks/results/newest_families/linear_attention_cpu.md), so a CPU row keeps one call per sample.
  Where fla is installed but cannot train, transformers' torch functions are used for single samples too (transformers
  picks fla's at import, and fla would stop the first backward).
"""

from __future__ import annotations

import contextvars
import functools
import importlib.util
import inspect
import itertools
import sys

import torch

from sft.model.attention import boundaries_from_positions

# transformers' classes of the layer (`<family>GatedDeltaNet`: Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet,
# Qwen3_5MoeGatedDeltaNet), which take (hidden_states, cache, attention_mask, **kwargs)
CLASS_SUFFIX = "GatedDeltaNet"
# the keyword arguments that describe the packed row's boundaries; none of them reaches a sample's own forward
BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx", "position_ids")
# flash-linear-attention (`fla-core`): transformers resolves `chunk_gated_delta_rule` to it at import where installed
FLA = importlib.util.find_spec("fla") is not None


# a group of samples in one batched recurrence pads each to the group's longest: at most this share more tokens
PADDING = 1.5


def fla_cannot_train() -> str | None:
    """Why flash-linear-attention's kernels cannot train on this machine, or None where they can (on a Hopper GPU
    under a Triton whose build of one of fla's backward kernels fla refuses, through `sft.model.fla_hopper`)."""
    if not FLA:
        return "flash-linear-attention is not installed (`pip install 'sft[fla]'`)"
    if not torch.cuda.is_available():
        return "no CUDA GPU here (its kernels are Triton's)"
    return None


def fla_note() -> str:
    """What the log says about fla's kernels beyond their name: where `sft.model.fla_hopper` stands in for one."""
    from sft.model import fla_hopper

    return fla_hopper.NOTE if fla_hopper.registered() else ""


def path(varlen: bool | None = None) -> str:
    """Which path a packed row takes on a GPU: "varlen" (fla installed and able to train, or `varlen` forced) or
    "per sample"."""
    return "varlen" if (fla_cannot_train() is None if varlen is None else varlen) else "per sample"


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith(CLASS_SUFFIX)]


def by_sample(model: torch.nn.Module, varlen: bool | None = None, batched: bool | None = None) -> int:
    """Each Gated DeltaNet layer of `model` given the boundaries of a packed row (returns how many layers): the
    layer's forward runs once on the whole row with `cu_seq_lens_q`, and its module's two sequence kernels restart at
    each boundary: fla's varlen kernels on a GPU where fla can train (`varlen` None) or where asked (True), else
    transformers' torch kernels, the recurrence batched over groups of samples where the row is on a GPU (`batched`
    None) or where asked (True), else once per sample. One forward per layer keeps the module calls the same on every
    process (DeepSpeed ZeRO-3 gathers each submodule's weights as it is called: a forward per sample made the
    processes' collectives differ). A decoder layer given only the row's positions (transformers keeps `position_ids`
    from its linear-attention layer) hands that layer the boundaries they mark."""
    found = layers(model)
    mode = "varlen" if path(varlen) == "varlen" else {None: "torch", True: "batched", False: "per sample"}[batched]
    if mode == "varlen" and FLA:
        from sft.model import fla_hopper

        fla_hopper.register()  # where fla would refuse its backward on this GPU and Triton
    for layer in found:
        _kernels_by_sample(sys.modules[type(layer).__module__])
        layer.forward = _with_boundaries(layer.forward, mode)
    for parent in model.modules():
        if any(child in found for child in parent.children()):
            parent.register_forward_pre_hook(_boundaries_from_positions, with_kwargs=True)
    return len(found)


def _boundaries_from_positions(module, args, kwargs):
    positions = kwargs.get("position_ids")
    if kwargs.get("cu_seq_lens_q") is None and positions is not None and positions.dim() == 2 and len(positions) == 1:
        return args, {**kwargs, "cu_seq_lens_q": boundaries_from_positions(positions)}
    return args, kwargs


def _bounds(kwargs: dict) -> torch.Tensor | None:
    """The row's sample boundaries (`cu_seq_lens_q`, else from its positions), as a tensor on the row's device."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return kwargs["cu_seq_lens_q"]
    if kwargs.get("position_ids") is not None:
        return boundaries_from_positions(kwargs["position_ids"])
    return None


# inside a converted layer's forward, its kernels' path: "varlen" (fla's), "batched", "per sample" or "torch" (batched
# on a GPU, per sample on the CPU: transformers' torch functions); None elsewhere (transformers' own)
_PATH: contextvars.ContextVar[str | None] = contextvars.ContextVar("sft_linear_attention_path", default=None)


def groups(lengths: list[int], padding: float = PADDING) -> list[list[int]]:
    """The samples (indices into `lengths`) in groups for one batched call each: longest first, a sample joining the
    current group while the group padded to its longest stays within `padding` x its tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    found: list[list[int]] = []
    for i in order:
        group = found[-1] if found else None
        if group and (len(group) + 1) * lengths[group[0]] <= padding * (sum(lengths[j] for j in group) + lengths[i]):
            group.append(i)
        else:
            found.append([i])
    return found


def _batched(torch_chunk, query, key, value, g, beta, bounds: list[int], **kwargs) -> torch.Tensor:
    """transformers' torch recurrence over a packed row's samples, each from a zero state: one call per group of
    `groups`, its samples the batch, zero-padded at their ends. Returns [1, tokens, value heads, value dim]."""
    starts, lengths = bounds[:-1], [hi - lo for lo, hi in itertools.pairwise(bounds)]
    pieces: list[torch.Tensor | None] = [None] * len(lengths)
    device = query.device
    for group in groups(lengths):
        longest = lengths[group[0]]
        first = torch.tensor([starts[i] for i in group], device=device)
        count = torch.tensor([lengths[i] for i in group], device=device)
        steps = torch.arange(longest, device=device)
        valid = steps[None, :] < count[:, None]  # [samples, longest]
        index = first[:, None] + torch.minimum(steps[None, :], count[:, None] - 1)

        def padded(x, valid=valid, index=index):
            picked = x[0, index]  # [samples, longest, ...]
            return picked * valid.view(*valid.shape, *([1] * (picked.dim() - 2))).to(picked.dtype)

        out = torch_chunk(padded(query), padded(key), padded(value), g=padded(g), beta=padded(beta), **kwargs)[0]
        for row, i in enumerate(group):
            pieces[i] = out[row, : lengths[i]]
    return torch.cat(pieces, dim=0).unsqueeze(0)


def _with_boundaries(forward, mode: str):
    # never traced into a compiled decoder layer (`compile_decoder_layers`): the token mixer runs as in an eager layer
    # (fla's Triton kernels, or transformers' torch functions per sample or group, whose boundaries the host reads),
    # and the layer's graph breaks around it; its MLP and norms compile
    @torch.compiler.disable
    @functools.wraps(forward)
    def run(hidden_states, cache=None, attention_mask=None, **kwargs):
        bounds = _bounds(kwargs) if hidden_states.shape[0] == 1 and cache is None else None
        rest = {k: v for k, v in kwargs.items() if k not in BOUNDARIES} if bounds is not None else kwargs
        token = _PATH.set(mode)
        try:
            if bounds is None or bounds.numel() <= 2:  # one sample (or a cache: generation), as transformers runs it
                return forward(hidden_states, cache=cache, attention_mask=attention_mask, **rest)
            cu = bounds.to(device=hidden_states.device, dtype=torch.long)
            return forward(hidden_states, attention_mask=attention_mask, cu_seq_lens_q=cu, **rest)
        finally:
            _PATH.reset(token)

    return run


def _kernels_by_sample(module) -> None:
    """transformers' `module`'s short convolution (`causal_conv1d_fn`, called with the layer's keyword arguments) and
    recurrence (`torch_chunk_gated_delta_rule`, given `cu_seqlens`) restarted at each boundary inside a converted
    layer: through fla's varlen kernels on a GPU where its `by_sample` chose them, else transformers' torch functions
    once per sample; without boundaries transformers' torch functions where fla is installed but not used (fla's
    backward may refuse). Outside a converted layer, exactly transformers' own. Replaced once per module."""
    if getattr(module.causal_conv1d_fn, "sft_by_sample", False):
        return
    conv, chunk = module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule
    torch_conv, torch_chunk = inspect.unwrap(conv), inspect.unwrap(chunk)

    def fast(tensor) -> bool:
        return _PATH.get() == "varlen" and tensor.is_cuda

    @functools.wraps(conv)
    def convolution(hidden_states, weight, bias=None, activation=None, **kwargs):
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None or _PATH.get() is None:
            return conv(hidden_states, weight, bias, activation=activation, **kwargs)
        if fast(hidden_states):
            from fla.modules.causal_conv1d import causal_conv1d

            # transformers' layout is [batch, channels, tokens], fla's [batch, tokens, channels]
            out, _ = causal_conv1d(hidden_states.transpose(1, 2).contiguous(), weight=weight, bias=bias,
                                   activation=activation, cu_seqlens=cu.long())  # fmt: skip
            return out.transpose(1, 2)
        return torch.cat([torch_conv(hidden_states[..., lo:hi], weight, bias, activation=activation)
                          for lo, hi in itertools.pairwise(cu.tolist())], dim=-1)  # fmt: skip

    @functools.wraps(chunk)
    def recurrence(query, key, value, g, beta, cu_seqlens=None, **kwargs):
        if _PATH.get() is None:
            return chunk(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, **kwargs)
        if cu_seqlens is None:
            return (chunk if fast(query) or not FLA else torch_chunk)(query, key, value, g=g, beta=beta, **kwargs)
        if fast(query):
            return chunk(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, **kwargs)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError("a packed row's linear attention runs from a zero state and keeps none (no cache)")
        bounds = cu_seqlens.tolist()
        if _PATH.get() == "batched" or (_PATH.get() == "torch" and query.is_cuda):
            return _batched(torch_chunk, query, key, value, g, beta, bounds, **kwargs), None
        outputs = [torch_chunk(query[:, lo:hi], key[:, lo:hi], value[:, lo:hi], g=g[:, lo:hi], beta=beta[:, lo:hi],
                               **kwargs)[0] for lo, hi in itertools.pairwise(bounds)]  # fmt: skip
        return torch.cat(outputs, dim=1), None

    convolution.sft_by_sample = True
    module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule = convolution, recurrence

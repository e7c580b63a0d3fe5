"""`sft.model.wide_heads.wide_varlen` (attention for heads wider than FlashAttention takes, as batched matrix products
over the row's samples) against transformers' own eager attention (Gemma 4's `eager_attention_forward`) one sample
at a time: outputs and q/k/v gradients in fp32 within 1e-5, causal, with a left window and both ways, grouped
key-value heads, samples of many lengths in one row, batches split by the score budget; and a sample's output and
gradients do not move when another sample's tokens change."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.gemma4.modeling_gemma4 import eager_attention_forward

from sft.model import wide_heads
from sft.model.wide_heads import length_groups, wide_varlen

LENGTHS = [1, 2, 3, 5, 8, 11, 16, 17, 23, 40, 64, 65, 90]


def reference(q, k, v, lengths, left: int, causal: bool):
    """transformers' eager attention, one sample at a time, each with its own causal (windowed) or full mask."""
    heads, kv_heads = q.shape[1], k.shape[1]
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, training=False, head_dim=q.shape[-1])
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].transpose(0, 1)[None] for t in (q, k, v))
        pos = torch.arange(n)
        allowed = pos[:, None] >= pos[None, :] if causal else torch.ones(n, n, dtype=torch.bool)
        if causal and left >= 0:
            allowed &= pos[:, None] - pos[None, :] <= left
        mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out, _ = eager_attention_forward(module, qs, ks, vs, mask[None, None])
        outs.append(out[0])
        start += n
    return torch.cat(outs)


def inputs(lengths, heads: int, kv_heads: int, dim: int = 16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, torch.randn(total, heads, dim, generator=gen)


def grads(fn, q, k, v, grad_out):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize(
    "heads,kv_heads,left,causal",
    [(8, 4, -1, True), (4, 4, -1, True), (6, 2, 4, True), (8, 4, -1, False), (2, 1, 1, True)],
)
@pytest.mark.parametrize("budget", [wide_heads.SCORE_BUDGET, 20_000, 1])
def test_wide_varlen_equals_eager_one_sample_at_a_time(monkeypatch, heads, kv_heads, left, causal, budget):
    # 20,000 (and 100 tokens a batch): the longest samples alone, in blocks of query rows; 1: every sample alone, one
    # query row at a time
    monkeypatch.setattr(wide_heads, "SCORE_BUDGET", budget)
    monkeypatch.setattr(wide_heads, "TOKEN_BUDGET", 100 if budget == 20_000 else wide_heads.TOKEN_BUDGET)
    q, k, v, cu, grad_out = inputs(LENGTHS, heads, kv_heads)
    window = (left, 0 if causal else -1)
    out, got = grads(lambda *t: wide_varlen(*t, cu, cu, 0, 0, window_size=window), q, k, v, grad_out)
    ref, want = grads(lambda *t: reference(*t, LENGTHS, left, causal), q, k, v, grad_out)
    assert rel(out, ref) < 1e-5
    for name, a, b in zip("qkv", got, want, strict=True):
        assert rel(a, b) < 1e-5, name


def test_a_sample_reads_only_itself():
    """Changing the second sample's queries, keys and values changes nothing of the others: their outputs and the
    gradients that reach their tokens (a leak either way would move them). The four share a padded batch."""
    lengths = [12, 14, 13, 10]
    assert [0, 1, 2, 3] in length_groups(lengths)
    q, k, v, cu, grad_out = inputs(lengths, 4, 2)
    other = slice(12, 26)

    def run(q, k, v):
        return grads(lambda *t: wide_varlen(*t, cu, cu, 0, 0), q, k, v, grad_out)

    out, got = run(q, k, v)
    q2, k2, v2 = (t.clone() for t in (q, k, v))
    for t in (q2, k2, v2):
        t[other] = torch.randn_like(t[other]) * 5
    out2, got2 = run(q2, k2, v2)
    keep = torch.ones(q.shape[0], dtype=torch.bool)
    keep[other] = False
    assert torch.equal(out[keep], out2[keep]) and not torch.allclose(out[other], out2[other])
    for a, b in zip(got, got2, strict=True):
        assert torch.equal(a[keep], b[keep])


def test_length_groups_pad_a_sample_at_most_twice():
    lengths = [1, 2, 3, 4, 5, 6, 7, 8, 9, 181, 256, 257, 362, 363, 4096]
    for group in length_groups(lengths):
        sizes = [lengths[i] for i in group]
        assert max(sizes) < 2 * min(sizes) or max(sizes) <= 2, sizes
    assert sorted(i for g in length_groups(lengths) for i in g) == list(range(len(lengths)))


@pytest.mark.parametrize("name", ["gemma4", "qwen2-window", "llama"])
def test_a_packed_row_through_wide_varlen_equals_each_sample_alone(monkeypatch, name):
    """A model whose every layer runs `wide_varlen` (as Gemma 4's full layers do on a GPU): the packed row's logits
    and every parameter's gradient of the summed loss equal each sample alone through eager (fp32, 1e-5)."""
    import itertools

    from transformers import AutoModelForCausalLM

    from sft.model import attention
    from tests.tiny_models import config_of, packed_batch

    monkeypatch.setattr(attention, "packed_kernel", lambda head_dim, on_gpu: wide_varlen)
    attention.register_varlen()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(name), attn_implementation="eager", dtype=torch.float32)
    model.config.use_cache = False
    batch = packed_batch(model.config.vocab_size)
    ids = batch["input_ids"][0]
    bounds = batch["cu_seq_lens_q"].tolist()

    def loss_of(logits, tokens):
        return torch.nn.functional.cross_entropy(logits[:-1], tokens[1:], reduction="sum")

    alone_logits, alone_loss = [], 0
    for lo, hi in itertools.pairwise(bounds):
        logits = model(input_ids=ids[None, lo:hi]).logits[0]
        alone_logits.append(logits.detach())
        alone_loss = alone_loss + loss_of(logits, ids[lo:hi])
    alone_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.set_attn_implementation(attention.VARLEN)
    logits = model(**{k: v for k, v in batch.items() if k not in ("labels", "seq_lengths")}).logits[0]
    packed_loss = sum(loss_of(logits[lo:hi], ids[lo:hi]) for lo, hi in itertools.pairwise(bounds))
    packed_loss.backward()
    for (lo, hi), single in zip(itertools.pairwise(bounds), alone_logits, strict=True):
        torch.testing.assert_close(logits[lo:hi].detach(), single, atol=1e-5, rtol=1e-5)
    for n, p in model.named_parameters():
        if n in want:
            assert rel(p.grad, want[n]) < 1e-5, n


@pytest.mark.parametrize("heads,kv_heads,causal", [(8, 4, True), (4, 2, False)])
def test_the_compiled_pointwise_work_equals_eager(monkeypatch, heads, kv_heads, causal):
    """The GPU's path compiles the pointwise work between the products (`FUSED`); compiled here on the CPU, the same
    comparison against eager one sample at a time holds (causal with grouped heads, and both ways)."""
    monkeypatch.setattr(wide_heads, "_pointwise", lambda fn, scores: wide_heads._compiled(fn))
    q, k, v, cu, grad_out = inputs(LENGTHS[:8], heads, kv_heads)
    window = (-1, 0 if causal else -1)
    out, got = grads(lambda *t: wide_varlen(*t, cu, cu, 0, 0, window_size=window), q, k, v, grad_out)
    ref, want = grads(lambda *t: reference(*t, LENGTHS[:8], -1, causal), q, k, v, grad_out)
    assert rel(out, ref) < 1e-5
    for name, a, b in zip("qkv", got, want, strict=True):
        assert rel(a, b) < 1e-5, name


def test_the_plan_counts_one_batch_in_flight_where_wide_varlen_runs(monkeypatch, tmp_path):
    """A Gemma 4 whose full layers have heads of 512: the plan adds `in_flight_bytes` to the backward's peak where the
    wide heads run `wide_varlen` (`SFT_WIDE_HEADS=matmul`), nothing under `efficient_varlen` or for a model without
    wide heads; the bound is one batch's scores at `SCORE_BUDGET` and a heads-first batch of `TOKEN_BUDGET` tokens."""
    from transformers import AutoConfig

    from sft.model import shapes
    from sft.plan import memory

    def shape_of(global_head_dim):
        config = AutoConfig.for_model("gemma4_text", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                                      global_head_dim=global_head_dim, vocab_size=1024,
                                      layer_types=["sliding_attention", "full_attention"])  # fmt: skip
        config.save_pretrained(tmp_path / str(global_head_dim))
        return shapes.load_shape(str(tmp_path / str(global_head_dim)))

    setting = memory.Setting(zero_stage=None, micro_batch=8, seq_len=4096)
    wide, narrow = shape_of(512), shape_of(256)
    assert (wide.wide_layers, wide.wide_head_dim, narrow.wide_layers) == (1, 512, 0)
    term = "wide heads' attention: one batch in flight"
    for kernel, counted in (("matmul", True), ("efficient", False)):
        monkeypatch.setenv("SFT_WIDE_HEADS", kernel)
        assert (term in memory.estimate(wide, setting).items) == counted
        assert term not in memory.estimate(narrow, setting).items
    expected = 12 * wide_heads.SCORE_BUDGET + 16 * wide_heads.TOKEN_BUDGET * 8 * 512
    assert wide_heads.in_flight_bytes(8, 512, 8 * 4096, 4096) == expected


def test_the_layers_of_a_micro_batch_share_one_plan():
    """The second layer given the same boundaries tensor reuses the first's batches (no second read of the lengths);
    another tensor, the same one written in place, or other heads get their own; every result stays exact."""
    q, k, v, cu, grad_out = inputs(LENGTHS, 8, 4)
    wide_varlen(q, k, v, cu, cu, 0, 0)
    first = wide_heads._last_plan.batches
    out = wide_varlen(q, k, v, cu, cu, 0, 0)
    assert wide_heads._last_plan.batches is first
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, -1, True), atol=1e-5, rtol=1e-5)
    for change in (lambda t: t.clone(), lambda t: t.add_(0)):  # a new tensor; the same one written in place
        before = wide_heads._last_plan.batches
        other = change(cu)
        wide_varlen(q, k, v, other, other, 0, 0)
        assert wide_heads._last_plan.batches is not before
    before = wide_heads._last_plan.batches
    k8, v8 = (t.repeat_interleave(2, dim=1) for t in (k, v))
    out = wide_varlen(q, k8, v8, cu, cu, 0, 0)
    assert wide_heads._last_plan.batches is not before
    torch.testing.assert_close(out, reference(q, k8, v8, LENGTHS, -1, True), atol=1e-5, rtol=1e-5)

"""GPU tier: skipped without CUDA. The full GPU evidence is benchmarks/*.py with its committed results."""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.model.attention import VARLEN, resolve_attn_implementation
from tests.conftest import ROOT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_auto_backend_is_varlen_or_flash_and_matches_sdpa_per_sample():
    chosen = resolve_attn_implementation("auto")
    assert chosen in {VARLEN, "flash_attention_2"}
    config = AutoConfig.from_pretrained(ROOT / "recipes" / "demo" / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda()
    rows = [{"input_ids": torch.randint(10, 100, (n,)).tolist(), "seq_lengths": [n]} for n in (7, 300, 45)]
    batch = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True)(rows)
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items() if k not in ("labels", "seq_idx")}
    with torch.no_grad():
        model.set_attn_implementation(chosen)
        packed = model(**batch).logits[0].float()
        model.set_attn_implementation("sdpa")
        bounds = batch["cu_seq_lens_q"].tolist()
        alone = torch.cat(
            [model(input_ids=batch["input_ids"][:, lo:hi]).logits[0].float() for lo, hi in itertools.pairwise(bounds)]
        )
    assert (packed - alone).abs().max().item() < 0.1  # bf16 rounding; fp32 would be ~1e-5


LIGER_CHECK = """
import sys, torch
from liger_kernel.transformers import LigerRMSNorm
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.liger import apply_liger_kernel

config = AutoConfig.from_pretrained(sys.argv[1]).to_dict()
config.update(model_type=sys.argv[2], architectures=None, head_dim=32, use_sliding_window=False)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.bfloat16).cuda()
ids = torch.randint(10, 100, (2, 64), device="cuda")
before = model(input_ids=ids, labels=ids).loss.item()
apply_liger_kernel(model, {"fused_linear_cross_entropy": False})  # as TRL configures it
norms = [m for n, m in model.named_modules() if n.endswith("norm")]
assert norms and all(getattr(m.forward, "__func__", None) is LigerRMSNorm.forward for m in norms), "not patched"
after = model(input_ids=ids, labels=ids)
after.loss.backward()
assert abs(after.loss.item() - before) < 0.02 * before, (before, after.loss.item())
"""


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral"])
def test_liger_patches_the_model_and_keeps_its_loss(model_type):
    """What `use_liger_kernel: true` does through transformers (TRL keeps its own fused LM-head loss). In a process
    of its own: Liger patches the modeling modules globally."""
    model_dir = str(ROOT / "recipes" / "demo" / "model")
    result = subprocess.run([sys.executable, "-c", LIGER_CHECK, model_dir, model_type], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("name", ["efficient_varlen", "wide_varlen"])
def test_wide_kernels_take_512_wide_heads_exactly_as_each_sample_alone(name):
    """The kernels for Gemma 4's full layers on a GPU (`efficient_varlen`, `sft.model.wide_heads.wide_varlen`): output
    and q/k/v gradients against fp32 sdpa one sample at a time, within what bf16 sdpa one sample at a time is off by
    itself (GQA 8/4, causal, samples of 1 to 700)."""
    from sft.model.attention import efficient_varlen, per_sample_sdpa
    from sft.model.wide_heads import wide_varlen

    kernel = {"efficient_varlen": efficient_varlen, "wide_varlen": wide_varlen}[name]

    torch.manual_seed(0)
    lengths = [1, 37, 300, 5, 700, 64]
    cu = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda", dtype=torch.int32)
    total, longest = sum(lengths), max(lengths)
    q, k, v = (torch.randn(total, h, 512, device="cuda") for h in (8, 4, 4))
    grad = torch.randn(total, 8, 512, device="cuda")

    def run(kernel, dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = kernel(*inputs, cu, cu, longest, longest, scale=0.05, window_size=(-1, 0))
        out.backward(grad.to(dtype))
        return [out.float(), *(t.grad.float() for t in inputs)]

    reference = run(per_sample_sdpa, torch.float32)

    def errors(kernel):
        return [float((a - b).norm() / b.norm()) for a, b in zip(run(kernel, torch.bfloat16), reference, strict=True)]

    # bf16 noise: at most 2.5x bf16 sdpa's own error against fp32, which is below bf16's machine epsilon (2^-7) (the
    # repeated key-value heads' gradients are summed in bf16; measured 0.0032-0.0051 against sdpa's 0.0031-0.0040 on
    # the H200, 2026-12-03, benchmarks/results/families_2026)
    fast, noise = errors(kernel), errors(per_sample_sdpa)
    assert all(n < 2**-7 and f < 2.5 * n for f, n in zip(fast, noise, strict=True)), (fast, noise)


def test_sfts_form_of_flas_gated_dqkwg_at_qwen3_5_widths_in_bf16():
    """`sft.model.fla_hopper.chunk_bwd_dqkwg` on the GPU at Qwen3.5's linear-attention widths (16 query-key heads,
    32 value heads, 128 wide; three packed sequences), bf16 inputs as fla gives them: against autograd of the chunk
    terms in float64 (tests/test_fla_hopper.py), and against fla's own kernel where fla runs it here (not on Hopper
    under Triton 3.4-3.7.0, which is why the torch form exists)."""
    from sft.model import fla_hopper
    from tests.test_fla_hopper import CHUNK, _inputs, _reference

    bounds = [0, 300, 1000, 1100]
    inputs = _inputs(1, 1100, 16, 32, bounds, False, k_dim=128, v_dim=128)
    q, k, v, do, h, dh, w, dv, g = (x.bfloat16() if x is not inputs[-1] else x for x in inputs)
    scale, cu = 128**-0.5, torch.tensor(bounds)
    want = _reference(q, k, v, do, h, dh, w, dv, g, scale, bounds, False)
    on_gpu = {n: x.cuda() for n, x in dict(q=q, k=k, v=v, w=w, g=g, h=h, dv=dv, do=do, dh=dh, cu_seqlens=cu).items()}
    kwargs = dict(**on_gpu, scale=scale, chunk_size=CHUNK)
    got = fla_hopper.chunk_bwd_dqkwg(**kwargs)
    for name, a, b in zip(("dq", "dk", "dw", "dg"), got, want, strict=True):
        assert float((a.double().cpu() - b).norm() / b.norm()) < 1e-2, name  # bf16 outputs: 0.001-0.003 on a CPU
    if importlib.util.find_spec("fla") is not None and not fla_hopper.needed():
        from fla.ops.common.chunk_o import chunk_bwd_dqkwg as flas

        theirs = flas(**kwargs)
        for name, a, b in zip(("dq", "dk", "dw", "dg"), got, theirs, strict=True):
            assert float((a.float() - b.float()).norm() / b.float().norm()) < 2e-2, name

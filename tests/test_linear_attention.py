"""Gated DeltaNet linear attention (Qwen3.5 dense and MoE, Qwen3-Next) over packed rows, one sample at a time
(`sft.model.linear_attention`): fp32, random weights, every layer kind present, packed rows equal their samples alone;
without the boundaries the recurrent state leaks from one sample into the next."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft.errors import ConfigError
from sft.model import architectures, linear_attention
from sft.model.attention import VARLEN, check_backend, register_varlen

register_varlen()
WIDTHS = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
              linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
              moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              num_hidden_layers=4)  # fmt: skip
FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
LENGTHS = ((13, 21, 5), (17, 30))  # two packed rows: samples shorter and longer than the convolution and a chunk


def build(model_type: str):
    torch.manual_seed(0)
    # Qwen3.5-MoE's config has no dense MLP width (every layer is experts)
    widths = {k: v for k, v in WIDTHS.items() if not (k == "intermediate_size" and model_type == "qwen3_5_moe_text")}
    config = AutoConfig.for_model(model_type, **widths)
    assert model_type != "qwen3_5_moe_text" or not hasattr(config, "intermediate_size")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


def packed() -> dict:
    torch.manual_seed(1)
    rows = [{"input_ids": torch.randint(3, 128, (sum(n),)).tolist(), "seq_lengths": list(n)} for n in LENGTHS]
    return DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)


@pytest.fixture(scope="module")
def models():
    return {family: build(family) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_their_samples_one_by_one(models, family):
    """Through sft's converter, a packed row's logits equal each sample alone through eager, within 1e-5 per token:
    with the collator's boundaries (`cu_seq_lens_q`, `seq_idx`) on `sft_varlen`, and with positions only on sdpa
    (the decoder layer hands its linear attention the boundaries the positions mark). Without the converter,
    transformers refuses the boundaries on its torch path, and given positions only its layers carry their state from
    one sample into the next: later samples differ by more than 1e-2."""
    model, batch = models[family], packed()
    arch = architectures.of(model.config)
    assert arch.attention.per_sample == ("linear_attention",) and arch.attention.other_layers == ()
    ids, bounds = batch["input_ids"], list(itertools.pairwise(batch["cu_seq_lens_q"].tolist()))
    with torch.no_grad():
        alone = [model(input_ids=ids[:, lo:hi]).logits[0] for lo, hi in bounds]
        model.set_attn_implementation("sdpa")
        leaked = model(input_ids=ids, position_ids=batch["position_ids"]).logits[0]
        model.set_attn_implementation(VARLEN)
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            model(**{k: v for k, v in batch.items() if k not in ("labels",)})
    differences = [float((leaked[lo:hi] - single).abs().max()) for (lo, hi), single in zip(bounds, alone, strict=True)]
    assert differences[0] < 1e-5 and min(differences[1:]) > 1e-2, differences

    converted = build(family)
    assert linear_attention.by_sample(converted) == 2
    with torch.no_grad():
        converted.set_attn_implementation(VARLEN)
        through_varlen = converted(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        converted.set_attn_implementation("sdpa")
        through_positions = converted(input_ids=ids, position_ids=batch["position_ids"]).logits[0]
    for (lo, hi), single in zip(bounds, alone, strict=True):
        torch.testing.assert_close(through_varlen[lo:hi], single, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(through_positions[lo:hi], single, atol=1e-5, rtol=1e-5)


def test_the_gradients_of_a_packed_row_are_its_samples(models):
    """The backward through the per-sample layers: the summed loss of a packed row gives every weight the gradient of
    its samples' losses summed one by one (Qwen3.5, fp32)."""
    batch = packed()
    ids, bounds = batch["input_ids"], list(itertools.pairwise(batch["cu_seq_lens_q"].tolist()))
    gradients = []
    for rows in ("packed", "alone"):
        model = build("qwen3_5_text").train()
        linear_attention.by_sample(model)
        model.set_attn_implementation(VARLEN)
        if rows == "packed":
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
            each = [logits[lo : hi - 1] for lo, hi in bounds]
        else:
            each = [model(input_ids=ids[:, lo:hi]).logits[0, :-1] for lo, hi in bounds]
        cross = torch.nn.functional.cross_entropy
        loss = sum(cross(x, ids[0, lo + 1 : hi], reduction="sum") for x, (lo, hi) in zip(each, bounds, strict=True))
        loss.backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys() and any("linear_attn" in n for n in gradients[0])
    for name in gradients[0]:
        torch.testing.assert_close(gradients[0][name], gradients[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_packing_and_sequence_parallelism_with_linear_attention():
    """Packing is allowed for the Gated DeltaNet families (their layers run by sample), still refused for a layer
    kind sft does not split; Ulysses, which would split the recurrence along the sequence, is refused."""
    from sft.parallel import sequence as seqpar

    qwen35 = AutoConfig.for_model("qwen3_5_text", **WIDTHS)
    check_backend(architectures.of(qwen35), VARLEN, padding_free=True, on_gpu=False)
    arch = architectures.of(qwen35)
    mamba = dataclasses.replace(arch, attention=dataclasses.replace(arch.attention, other_layers=("mamba",)))
    with pytest.raises(ConfigError, match="mamba layers, to which sft cannot pass the sample boundaries"):
        check_backend(mamba, VARLEN, padding_free=True, on_gpu=False)
    with pytest.raises(ConfigError, match=r"\['linear_attention'\] layers, which Ulysses cannot split"):
        seqpar.check_model(qwen35, 2, VARLEN, architectures.of(qwen35))


def test_the_varlen_path_keeps_cpu_rows_on_the_per_sample_path(models):
    """With fla's varlen path asked for (as where fla is installed), a CPU row still runs its kernels one sample at a
    time (fla's are Triton's, for GPUs): packed equals alone."""
    import sys

    batch = packed()
    ids, bounds = batch["input_ids"], list(itertools.pairwise(batch["cu_seq_lens_q"].tolist()))
    model = build("qwen3_5_text")
    assert linear_attention.path(True) == "varlen" and linear_attention.by_sample(model, varlen=True) == 2
    module = sys.modules[type(linear_attention.layers(model)[0]).__module__]
    assert module.causal_conv1d_fn.sft_by_sample
    with torch.no_grad():
        model.set_attn_implementation(VARLEN)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
    for lo, hi in bounds:
        torch.testing.assert_close(logits[lo:hi], models["qwen3_5_text"](input_ids=ids[:, lo:hi]).logits[0],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_the_samples_are_grouped_within_the_padding_bound():
    """`groups`: longest first, a group padded to its longest holds at most 1.5 x its tokens; every sample once."""
    lengths = [4000, 30, 31, 29, 900, 880, 870, 12]
    found = linear_attention.groups(lengths)
    assert sorted(i for group in found for i in group) == list(range(len(lengths)))
    for group in found:
        assert len(group) * lengths[group[0]] <= 1.5 * sum(lengths[i] for i in group)
        assert lengths[group[0]] == max(lengths[i] for i in group)
    assert found == [[0], [4, 5, 6, 2], [1, 3, 7]]  # 4 x 900 <= 1.5 x 2,681 tokens; 4,000 alone


def test_the_batched_recurrence_equals_one_call_per_sample(monkeypatch):
    """A row of six samples of 3-70 tokens (two groups: 70, 40, 38 and 11, 9, 3): the batched recurrence against one
    call per sample, the logits and every weight's gradient (fp32, within 1e-5 / 1e-4), in 2 calls of transformers'
    recurrence per layer instead of 6. By default (`batched=None`) a row on the CPU keeps one call per sample, where
    the batched form measured no faster (`by_sample`'s docstring): the same logits, and no batched call."""
    torch.manual_seed(3)
    lengths = (70, 9, 11, 40, 38, 3)
    rows = [{"input_ids": torch.randint(3, 128, (sum(lengths),)).tolist(), "seq_lengths": list(lengths)}]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(rows)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    calls = []
    batched = linear_attention._batched

    def counted(torch_chunk, *args, **kwargs):
        def chunk(*a, **k):
            calls.append(a[0].shape[0])  # the samples in this call
            return torch_chunk(*a, **k)

        return batched(chunk, *args, **kwargs)

    monkeypatch.setattr(linear_attention, "_batched", counted)
    results = {}
    for together in (False, True, None):
        model = build("qwen3_5_text").train()
        linear_attention.by_sample(model, batched=together)
        model.set_attn_implementation(VARLEN)
        logits = model(**inputs).logits[0]
        logits.float().pow(2).mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[together] = (logits.detach(), grads)
    (one, one_grads), (many, many_grads) = results[False], results[True]
    torch.testing.assert_close(many, one, atol=1e-5, rtol=1e-5)
    assert one_grads.keys() == many_grads.keys()
    for name, grad in one_grads.items():
        torch.testing.assert_close(many_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert calls == [3, 3] * 2, calls  # two linear-attention layers, two calls each (and none by default on CPU)
    torch.testing.assert_close(results[None][0], one, atol=0, rtol=0)


@pytest.mark.full
@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_compiled_layers_keep_the_token_mixer_out_of_their_graph(family):
    """`compile_decoder_layers` on a Qwen3.5 model over packed rows: each Gated DeltaNet token mixer runs outside the
    layer's graph (`torch.compiler.disable`: its kernels restart at the boundaries the host reads), the rest compiles;
    logits and every gradient equal eager's (fp32, CPU; gradients within 1e-5 of the largest gradient's norm: the
    tiny-norm ones of a mixer's gate differ by rounding, 4e-11)."""
    from sft.model.converters import compile_decoder_layers
    from tests.tiny_models import eager_and_compiled

    register_varlen()
    eager, compiled = (build(family) for _ in range(2))
    for model in (eager, compiled):
        model.set_attn_implementation(VARLEN)
        model.train()
        linear_attention.by_sample(model)
    compiled.load_state_dict(eager.state_dict())
    compile_decoder_layers(compiled)
    batch = {k: v for k, v in packed().items() if k != "seq_idx"}
    logits, grads = eager_and_compiled(eager, compiled, batch)
    assert logits < 1e-5
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 40
    largest = max(float(g.norm()) for g in grads[0].values())
    assert max(float((grads[0][n] - grads[1][n]).norm()) for n in grads[0]) < 1e-5 * largest

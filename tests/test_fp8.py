"""FP8 (`sft.model.fp8`): the config and its `auto` resolution, the refusals, the layer filter, the conversion
(torchao's float8 matmuls run on the CPU), the ZeRO-3-safe weight saving, the padding the float8 matmuls need, the plan
term and the fingerprint. The runs under DeepSpeed are in tests/multiproc/test_fp8_runs.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from sft.errors import ConfigError
from sft.model import fp8, shapes
from sft.plan import memory as plan
from sft.plan.preflight import preflight
from sft.run.checkpoint import compare_fingerprints
from tests.conftest import ROOT
from tests.helpers import demo_args

DEMO = ROOT / "recipes" / "demo" / "model"


def demo_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO))


def test_resolve_refuses_and_decides(monkeypatch):
    monkeypatch.delenv(fp8.CPU_ENV, raising=False)
    assert fp8.resolve(False, False, 4096, False) == fp8.Decision(False, "fp8: false")
    with pytest.raises(ConfigError, match=r"`fp8: true` needs a GPU with FP8 tensor cores .* this machine has no GPU"):
        fp8.resolve(True, False, 4096, False)
    with pytest.raises(ConfigError, match=r"`fp8: true` with `use_peft`: FP8 is not supported with LoRA/QLoRA"):
        fp8.resolve(True, False, 4096, True)
    assert fp8.resolve(False, True, 4096, False) == fp8.Decision(False, "no GPU with FP8 tensor cores")
    monkeypatch.setenv(fp8.CPU_ENV, "1")
    assert fp8.resolve(True, False, 4096, False).on
    assert not fp8.resolve(False, True, 4096, False).on  # `auto` never takes the CPU path


def test_config_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"`fp8` must be true, false or `auto`, got 'sometimes'"):
        demo_args(tmp_path, "--fp8", "sometimes")
    with pytest.raises(ConfigError, match=r"--fp8_recipe.*invalid choice: 'blockwise' \(choose from 'tensorwise'"):
        demo_args(tmp_path, "--fp8_recipe", "blockwise")  # argparse's choices, as sft's one-paragraph error
    _, _, args, _ = demo_args(tmp_path)
    assert {"fp8", "compile_decoder_layers"} <= args.auto_settings and args.fp8_recipe == "tensorwise"


def test_preflight_without_fp8_gpu_turns_auto_off_and_true_is_refused(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv(fp8.CPU_ENV, raising=False)
    _, _, args, model_args = demo_args(tmp_path)
    with caplog.at_level(logging.INFO, logger="sft.plan"):
        resolved = preflight(args, model_args).training_args
    assert resolved.fp8 is False and resolved.compile_decoder_layers is False
    assert resolved.pad_to_multiple_of is None
    assert "FP8: off (no GPU with FP8 tensor cores)" in caplog.text
    _, _, args, model_args = demo_args(tmp_path, "--fp8", "true")
    with pytest.raises(ConfigError, match="needs a GPU with FP8 tensor cores"):
        preflight(args, model_args)
    _, _, args, model_args = demo_args(
        tmp_path, "--fp8", "true", "--use_peft", "--model_name_or_path", str(DEMO), "--from_scratch", "false"
    )
    with pytest.raises(ConfigError, match="not supported with LoRA/QLoRA"):
        preflight(args, model_args)


def test_fp8_pads_packed_rows_to_a_multiple_of_16(tmp_path, monkeypatch):
    """The weight-gradient matmul's inner dimension is the micro-batch's tokens: with FP8 on, TRL's padding-free
    collator pads the row to a multiple of 16 (one-token samples, no loss), and compiling is switched on."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    monkeypatch.setenv(fp8.CPU_ENV, "1")
    _, _, args, model_args = demo_args(tmp_path, "--fp8", "true", "--pad_to_multiple_of", "8")
    resolved = preflight(args, model_args).training_args
    assert resolved.fp8 is True and resolved.compile_decoder_layers is True
    assert resolved.pad_to_multiple_of == 16  # lcm(8, 16)
    collator = DataCollatorForLanguageModeling(pad_token_id=1, padding_free=True, pad_to_multiple_of=16)
    batch = collator([{"input_ids": list(range(5, 12))}, {"input_ids": list(range(5, 30))}])
    assert batch["input_ids"].shape == (1, 32)
    assert (batch["labels"][0, 32 - 16 :] == -100).sum() >= 16 - (7 + 25 - 16)


def test_layer_filter_is_torchaos_on_the_full_shape():
    """Decoder linears only; torchao's thresholds (rowwise skips N <= 2048 or K <= 1024); ZeRO-3's `ds_shape` read."""
    from benchmarks.common import LLAMA_SHAPES

    config = AutoConfig.for_model(**LLAMA_SHAPES["llama-1b"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    from sft.model.architectures import decoder_prefixes

    prefixes = decoder_prefixes(model)
    assert prefixes == tuple(f"model.layers.{i}." for i in range(config.num_hidden_layers))
    rowwise, tensorwise = fp8.layer_filter("rowwise", prefixes), fp8.layer_filter("tensorwise", prefixes)
    layer = model.model.layers[0]
    names = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
    picked = {n: (rowwise(layer.get_submodule(n), f"model.layers.0.{n}"),
                  tensorwise(layer.get_submodule(n), f"model.layers.0.{n}")) for n in names}  # fmt: skip
    assert picked == {
        "self_attn.q_proj": (False, True),  # 2048 x 2048
        "self_attn.k_proj": (False, False),  # 512 x 2048
        "self_attn.o_proj": (False, True),
        "mlp.gate_proj": (True, True),  # 8192 x 2048
        "mlp.down_proj": (False, True),  # 2048 x 8192
    }
    assert not tensorwise(model.lm_head, "lm_head")
    partitioned = torch.nn.Linear(2, 2)
    partitioned.weight = torch.nn.Parameter(torch.empty(0))
    partitioned.weight.ds_shape = torch.Size([8192, 2048])
    assert rowwise(partitioned, "model.layers.3.mlp.up_proj")


def test_conversion_trains_close_to_fp32_and_saves_plain_weights():
    model = demo_model()
    reference = copy.deepcopy(model)
    assert fp8.convert(model, "tensorwise", size_filter=False) == 4 * 7
    assert type(model.lm_head) is torch.nn.Linear
    ids = torch.randint(0, model.config.vocab_size, (2, 64))
    losses = [m(input_ids=ids, labels=ids).loss for m in (model, reference)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() != losses[1].item()
    assert abs(losses[0].item() - losses[1].item()) / losses[1].item() < 1e-3
    grads = [dict(m.named_parameters())["model.layers.1.mlp.down_proj.weight"].grad for m in (model, reference)]
    # the output gradient in e5m2 (2 mantissa bits): about 10% per element, the direction kept
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 0.2
    assert float(torch.nn.functional.cosine_similarity(grads[0].flatten(), grads[1].flatten(), dim=0)) > 0.98
    assert model.state_dict().keys() == reference.state_dict().keys()
    with pytest.raises(ConfigError, match="no decoder linear layer is large enough for rowwise float8"):
        fp8.convert(demo_model(), "rowwise")  # torchao's thresholds: the demo's layers are far too small


def test_backward_reads_the_weight_as_it_is_then():
    """ZeRO-3 frees a gathered weight after the forward and gathers it again for the backward by replacing the
    parameter's data: the backward must use the parameter (sft's float8 linear), not a view kept from the forward
    (torchao's own `Float8Linear`, whose saved transpose keeps the forward's storage alive)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    grads = {}
    for name, cls in (("sft", fp8._leaf_weight_float8_linear()), ("torchao", Float8Linear)):
        torch.manual_seed(0)
        layer = cls.from_float(torch.nn.Linear(32, 32, bias=False), config=config)
        x = torch.randn(16, 32, requires_grad=True)
        y = layer(x)
        layer.weight.data = 2 * layer.weight.data  # what ZeRO-3's release and re-gather amount to here
        y.sum().backward()
        grads[name] = x.grad
    expected = 2 * torch.ones(16, 32) @ (layer.weight.data / 2)  # d(sum y)/dx with the re-gathered weight

    def off(a, b):
        return float((a - b).norm() / b.norm())

    assert off(grads["sft"], expected) < 0.1
    assert off(grads["torchao"], expected / 2) < 0.1  # the stale copy, kept alive


def test_plan_counts_fp8_and_says_so(tmp_path):
    import json

    from benchmarks.common import LLAMA_SHAPES

    (tmp_path / "config.json").write_text(json.dumps(LLAMA_SHAPES["llama-8b"]))
    shape = shapes.load_shape(str(tmp_path / "config.json"))
    base = plan.Setting(seq_len=4096, micro_batch=8, liger=True)  # the peak in the backward
    with_fp8 = plan.Setting(seq_len=4096, micro_batch=8, liger=True, fp8=True)
    a, b = plan.estimate(shape, base), plan.estimate(shape, with_fp8)
    extra = b.items["FP8 casts in flight (largest linear)"]
    assert extra == 2 * 32768 * (14336 + 4096) + 2 * 4096 * 14336
    assert b.at_backward - a.at_backward == extra
    assert with_fp8.describe().endswith(", FP8") and "FP8" not in base.describe()


def test_fingerprint_fp8_mismatch_is_refused_and_old_checkpoints_resume():
    old = {"model": "m", "seed": 1}
    compare_fingerprints(old, {**old, "fp8": False}, "ckpt")  # written before the key existed: bf16
    with pytest.raises(ConfigError, match="fp8: checkpoint 'rowwise' vs now False"):
        compare_fingerprints({**old, "fp8": "rowwise"}, {**old, "fp8": False}, "ckpt")


def test_auto_on_an_fp8_gpu_follows_the_measurements(monkeypatch):
    """`auto` where a GPU with FP8 tensor cores is found (the detection stands in for the H200 the benchmark ran on):
    on from the width where FP8 measured faster, off for LoRA and under ZeRO-3."""
    monkeypatch.setattr(fp8, "fp8_gpu", lambda: "NVIDIA H200")
    assert fp8.resolve(False, True, 4096, False).on
    assert fp8.resolve(False, True, fp8.AUTO_MIN_HIDDEN, False).on
    assert fp8.resolve(False, True, 1024, False) == fp8.Decision(
        False, f"hidden size 1024 < {fp8.AUTO_MIN_HIDDEN}, where FP8 measured no faster"
    )
    assert fp8.resolve(False, True, 4096, True) == fp8.Decision(False, "LoRA/QLoRA trains in bf16")
    assert not fp8.resolve(False, True, 4096, False, under_zero3=True).on
    assert fp8.resolve(True, False, 4096, False, under_zero3=True).on  # asked for: runs, with the measured warning


def test_fp8_under_zero3_is_compiled_and_says_it_measured_slower(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(fp8.CPU_ENV, "1")
    _, _, args, model_args = demo_args(tmp_path, "--fp8", "true", "--deepspeed", str(ROOT / "ds_configs/zero3.json"))
    with caplog.at_level(logging.INFO, logger="sft.plan"):
        resolved = preflight(args, model_args).training_args
    assert resolved.fp8 is True and resolved.compile_decoder_layers is True
    assert fp8.ZERO3_SLOWER in caplog.text and "0.875x" in caplog.text


def test_tiled_mlp_tiles_are_multiples_of_16_with_fp8():
    """With FP8 each MLP tile is a float8 matmul's inner dimension in the backward: tiles of a multiple of 16 tokens,
    the output as without tiles."""
    from sft.model import tiling

    model = demo_model()
    mlp = model.model.layers[0].mlp
    x = torch.randn(1, 37, model.config.hidden_size)
    expected = mlp(x)
    seen = []
    mlp.down_proj.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0].shape[-2]))
    assert tiling.apply_tiled_mlp(model, 2, fp8.TOKEN_MULTIPLE) == model.config.num_hidden_layers
    out = mlp(x)
    assert seen == [32, 32]  # 37 tokens padded to 64, two tiles
    assert torch.allclose(out, expected, atol=1e-6)


def test_fsdp2_conversion_all_gathers_float8_with_fp32_masters_and_real_addresses():
    """For FSDP2 (tensorwise): torchao's own Float8Linear with float8 all-gather; each wrapped weight cast to fp32
    before it is wrapped (accelerate's later cast would change only the wrapper's dtype: the wrapped tensor stayed
    bf16, checked here), and its `data_ptr()` the wrapped storage's (0 would let accelerate point every optimizer
    entry at one weight)."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    for master in (True, False):
        model = demo_model().to(torch.bfloat16)
        assert fp8.convert(model, "tensorwise", size_filter=False, fsdp2=True, fp32_master=master) == 28
        linears = [m for m in model.modules() if isinstance(m, Float8Linear)]
        assert len(linears) == 28 and all(m.config.enable_fsdp_float8_all_gather for m in linears)
        weights = [m.weight for m in linears]
        assert all(isinstance(w, WeightWithDynamicFloat8CastTensor) for w in weights)
        assert {w._tensor.dtype for w in weights} == {torch.float32 if master else torch.bfloat16}
        addresses = {w.data_ptr() for w in weights}
        assert len(addresses) == 28 and 0 not in addresses
        if not master:  # what accelerate's upcast does to a wrapped bf16 weight: the wrapped tensor stays bf16
            weights[0].data = weights[0].data.to(torch.float32)
            assert weights[0].dtype == torch.float32 and weights[0]._tensor.dtype == torch.bfloat16
    model = demo_model()
    fp8.convert(model, "rowwise", size_filter=False, fsdp2=True)
    assert not any(m.config.enable_fsdp_float8_all_gather for m in model.modules() if isinstance(m, Float8Linear))

"""The model matrix on the CPU (fp32, tiny configs of each family): what `sft.model.architectures` reads from a config
is what transformers' attention layers ask for, and a packed row through the backend sft picks (and through
`sft_varlen`, where it can honour the model) equals each sample alone through transformers' own `eager` attention, per
token."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM

from sft.errors import ConfigError
from sft.model import architectures
from sft.model.attention import HANDLED, INERT, VARLEN, check_backend, resolve_attn_implementation
from tests.tiny_models import BASE, FAMILIES, LENGTHS, WINDOW, config_of, packed_batch


@pytest.fixture(scope="module")
def models():
    """One fp32 model per family (eager attention), same weights for every backend."""
    built = {}
    for name in FAMILIES:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config_of(name), attn_implementation="eager", dtype=torch.float32)
        model.config.use_cache = False
        for p in model.parameters():  # sinks and other zero-initialised parameters: non-trivial values
            if p.dim() == 1 and not p.abs().sum():
                torch.nn.init.normal_(p, std=0.5)
        built[name] = model.eval()
    return built


def per_token_losses(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="none")


def test_the_features_are_what_transformers_passes(models):
    """Per layer, the window, soft-cap and sinks `sft.model.architectures` reads from the config equal the arguments
    transformers hands the attention function; no family passes an argument sft does not know (a new one in a later
    transformers fails here instead of being ignored)."""
    seen: dict[int, dict] = {}

    def spy(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = kwargs  # recorded only: the output's values do not matter here
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    AttentionInterface.register("sft_spy", spy)
    for name, model in models.items():
        seen.clear()
        batch = packed_batch(model.config.vocab_size)
        model.set_attn_implementation("sft_spy")
        try:
            model(**{k: v for k, v in batch.items() if k not in ("labels", "seq_lengths")})
        finally:
            model.set_attn_implementation("eager")
        arch = architectures.of(model.config)
        assert arch.known, name
        assert len(seen) == arch.layers
        windows = tuple(seen[i].get("sliding_window") for i in range(arch.layers))
        assert windows == arch.attention.windows, name
        assert {seen[i].get("softcap") for i in seen} == {arch.attention.softcap}, name
        assert {seen[i].get("s_aux") is not None for i in seen} == {arch.attention.sinks}, name
        names = set().union(*(kwargs.keys() for kwargs in seen.values()))
        assert names <= HANDLED | INERT | {"softcap", "s_aux"}, (name, names - HANDLED - INERT)
    assert architectures.of(config_of("qwen2-window")).attention.windows == (None, None, WINDOW, WINDOW)
    assert architectures.of(config_of("gemma3")).attention.windows == (WINDOW, None, WINDOW, None)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES)
def test_packed_row_equals_eager_one_sample_at_a_time(models, name, backend):
    """fp32, per token within 1e-5: the packed row through the backend sft picks on this machine (`auto`: sft_varlen
    on the CPU) or through sdpa with the block mask transformers builds from the position ids (where the family's
    mask is built from them and sdpa honours its attention; refused elsewhere), against each sample alone through
    eager."""
    model = models[name]
    arch = architectures.of(model.config)
    batch = packed_batch(model.config.vocab_size)
    ids = batch["input_ids"][0]
    bounds = batch["cu_seq_lens_q"].tolist()
    with torch.no_grad():
        alone = [model(input_ids=ids[None, lo:hi]).logits[0] for lo, hi in itertools.pairwise(bounds)]
    needs_scores = arch.attention.softcap is not None or arch.attention.sinks
    if backend == "sdpa" and (needs_scores or not arch.packed_mask):
        with pytest.raises(ConfigError, match="sdpa"):
            resolve_attn_implementation(backend, False, arch, padding_free=True)
        return
    chosen = resolve_attn_implementation(backend, False, arch, padding_free=True)  # refuses what would drop a feature
    assert chosen == (VARLEN if backend == "auto" else "sdpa")
    model.set_attn_implementation(chosen)
    try:
        inputs = {k: v for k, v in batch.items() if k not in ("labels", "seq_lengths")}
        with torch.no_grad():
            packed = model(**inputs).logits[0]
    finally:
        model.set_attn_implementation("eager")
    for (lo, hi), single in zip(itertools.pairwise(bounds), alone, strict=True):
        torch.testing.assert_close(packed[lo:hi], single, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            per_token_losses(packed[lo:hi], ids[lo:hi]), per_token_losses(single, ids[lo:hi]), atol=1e-5, rtol=1e-5
        )


def test_gpt_oss_mask_mixes_packed_samples(models):
    """Why `packed_mask` is false for gpt-oss: transformers builds its mask without the position ids, so through eager
    (or sdpa, flex) a packed row's later samples see the earlier ones. If a transformers release fixes it, this fails:
    then gpt-oss can leave MASK_WITHOUT_POSITIONS."""
    model = models["gpt_oss"]
    batch = packed_batch(model.config.vocab_size)
    ids, first = batch["input_ids"][0], LENGTHS[0]
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        second = model(input_ids=ids[None, first : first + LENGTHS[1]]).logits[0]
    assert (packed[first : first + LENGTHS[1]] - second).abs().max() > 1e-2
    assert {f for f, _ in FAMILIES.values() if not architectures.of(config_of_type(f)).packed_mask} == {"gpt_oss"}


def config_of_type(model_type: str):
    return next(config_of(n) for n, (t, _) in FAMILIES.items() if t == model_type)


def test_a_backend_that_would_drop_a_feature_is_refused():
    gemma2, gpt_oss, mistral = (architectures.of(config_of(n)) for n in ("gemma2", "gpt_oss", "mistral-window"))
    with pytest.raises(ConfigError, match=r"sdpa.*soft-capping at 5.*Use `auto`, or one of \['eager', 'flash"):
        check_backend(gemma2, "sdpa", padding_free=False)
    with pytest.raises(ConfigError, match="attention sinks"):
        check_backend(gpt_oss, "flash_attention_2", padding_free=True)
    with pytest.raises(ConfigError, match="without the position ids"):
        check_backend(gpt_oss, "eager", padding_free=True)
    check_backend(gpt_oss, "eager", padding_free=False)  # unpacked rows: its own mask is right
    check_backend(gemma2, "flash_attention_2", padding_free=True)  # flash-attn has soft-capping
    check_backend(mistral, VARLEN, padding_free=True, on_gpu=False)  # the CPU path masks the window
    assert resolve_attn_implementation("auto", True, gemma2, padding_free=True) == VARLEN  # also under Ulysses
    next_config = AutoConfig.for_model(
        "qwen3_next", **{**BASE, "layer_types": ["linear_attention", "full_attention"] * 2}
    )
    qwen3_next = architectures.of(next_config)
    # its linear attention runs one sample at a time over packed rows (tests/test_linear_attention.py, which also
    # checks that a layer kind sft does not split is refused for packing)
    assert qwen3_next.attention.per_sample == ("linear_attention",) and qwen3_next.attention.other_layers == ()
    assert "linear_attention layers (each packed sample from its own zero state)" in qwen3_next.describe()
    check_backend(qwen3_next, "sdpa", padding_free=True)


def test_experts_and_active_flops():
    """The MoE layout from each family's config, and FLOPs per token on the active experts only."""
    layouts = {n: architectures.of(config_of(n)).experts for n in ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")}
    # the router's load-balancing coefficient as each config declares it (GLM-4-MoE declares none)
    assert layouts["qwen3_moe"] == architectures.Experts(4, 2, 32, 4, router_aux=0.001, routes=True)
    assert layouts["mixtral"] == architectures.Experts(4, 2, 96, 4, router_aux=0.001, routes=True)
    assert layouts["glm4_moe"] == architectures.Experts(4, 2, 32, 3, shared=1, shared_width=32, routes=True)
    assert layouts["gpt_oss"] == architectures.Experts(4, 2, 96, 4, router_aux=0.001, routes=True)
    assert architectures.of(config_of("llama")).experts is None
    config = config_of("qwen3_moe")
    model = AutoModelForCausalLM.from_config(config)
    h, width, layers, vocab = 64, 32, 4, 256
    attention = h * 4 * 16 + 2 * h * 2 * 16 + 4 * 16 * h  # q, k, v, o
    experts_active = 2 * 3 * h * width  # gate, up, down of 2 of the 4 experts
    router = 4 * h
    assert architectures.matmul_flops_per_token(model, architectures.of(config)) == 6 * (
        layers * (attention + experts_active + router) + vocab * h
    )


def test_windowed_attention_flops():
    arch = architectures.of(config_of("qwen2-window"))  # 2 full layers, 2 with a window of 8
    lengths = torch.tensor([5, 20])
    full = (25 + 400) / 2
    windowed = 25 / 2 + (64 / 2 + 12 * 8)
    assert arch.attention_pairs(lengths).item() == 2 * full + 2 * windowed


def test_decoder_layers_under_peft_and_the_generic_family():
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_config(config_of("llama"))
    layers = architectures.decoder_layers(model)
    assert layers is model.model.layers
    wrapped = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    assert architectures.decoder_layers(wrapped) is layers
    assert architectures.decoder_prefixes(wrapped)[0] == "base_model.model.model.layers.0."
    arch = architectures.of(AutoConfig.for_model("starcoder2", **BASE))
    assert (
        not arch.known
        and not arch.kernel("liger").on
        and "not in sft's architecture table" in arch.kernel("fp8").reason
    )


@pytest.mark.parametrize(("window", "softcap", "sinks"), [(None, 5.0, False), (8, None, True), (8, 3.0, True)])
def test_the_gpu_scored_path_is_the_cpu_one(window, softcap, sinks):
    """sft_varlen's GPU path for soft-capping and sinks (flex_attention over a block mask of the samples, sinks by
    renormalising with its log-sum-exp) computes what its CPU path computes (the eager arithmetic, sample by sample):
    run here with flex_attention uncompiled."""
    from torch.nn.attention.flex_attention import flex_attention

    from sft.model.attention import _flex_scored, scored_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(40, heads, 16) for heads in (4, 2, 2))
    cu = torch.tensor([0, 13, 30, 40], dtype=torch.int32)
    s = torch.randn(4) if sinks else None
    expected = scored_attention(q, k, v, cu, 0.25, window, softcap, s)
    for multiple in (None, 16):  # as it is, and padded to 48 tokens (a fourth sample no real token sees)
        got = _flex_scored(q, k, v, cu, 0.25, window, softcap, s, flex=flex_attention, multiple=multiple)
        torch.testing.assert_close(got, expected)


def test_per_layer_widths_are_planned_and_what_else_varies_is_refused(monkeypatch):
    """Gemma 4 (transformers' per-layer configs: head dim 512 on its 5 full layers, 256 on its 25 sliding ones): the
    plan reads the layers' means, the attention backends the widest head (FlashAttention's kernels take 256: refused on
    a GPU, sdpa and eager honour it; sft_varlen per layer: FA2 on a GPU where the heads fit, `wide_varlen` (or
    `efficient_varlen`, SFT_WIDE_HEADS=efficient) over the row's samples on the wider ones, sdpa per sample on the
    CPU); a layer that varies in anything else is refused, naming it."""
    from sft.model.attention import check_backend, efficient_varlen, packed_kernel, per_sample_sdpa
    from sft.model.wide_heads import wide_varlen

    arch = architectures.of(AutoConfig.for_model("gemma4_text"))
    assert arch.attention.head_dims.count(512) == 5 and arch.attention.head_dims.count(256) == 25
    assert arch.head_dim == round((5 * 512 + 25 * 256) / 30) and arch.kv_head_counts == (4,) * 30
    assert "a head dim of 512 on 5 of 30 layers (FlashAttention's kernels take at most 256)" in arch.describe()
    for backend in ("flash_attention_2", "flash_attention_3"):
        with pytest.raises(ConfigError, match=f"`attn_implementation: {backend}` cannot honour .* a head dim of 512"):
            check_backend(arch, backend, padding_free=True, on_gpu=True)
    for backend, on_gpu in (("sdpa", True), ("eager", True), (VARLEN, False), (VARLEN, True)):
        check_backend(arch, backend, padding_free=True, on_gpu=on_gpu)
    assert packed_kernel(512, on_gpu=True) is wide_varlen and packed_kernel(256, on_gpu=False) is per_sample_sdpa
    monkeypatch.setenv("SFT_WIDE_HEADS", "efficient")
    assert packed_kernel(512, on_gpu=True) is efficient_varlen
    monkeypatch.setenv("SFT_WIDE_HEADS", "flex")
    with pytest.raises(ConfigError, match="SFT_WIDE_HEADS='flex': use one of matmul, efficient"):
        packed_kernel(512, on_gpu=True)
    monkeypatch.delenv("SFT_WIDE_HEADS")
    if torch.cuda.is_available():  # the GPU's varlen FlashAttention-2 for the layers whose heads it takes
        assert packed_kernel(256, on_gpu=True) is not per_sample_sdpa
    moe = architectures.of(config_of("gemma4_moe"))
    assert moe.kv_head_counts == (2, 1, 2, 1) and moe.experts.active == 2 and moe.experts.shared_width == 96
    assert architectures.of(config_of("gemma4")).intermediate == 96 * 6 // 4  # two of four layers twice as wide
    varying = AutoConfig.for_model("gemma4_text", per_layer_config={"1": {"intermediate_size": 128}})
    with pytest.raises(ConfigError, match=r"gemma4_text: its layers differ in intermediate_size \(a per-layer config"):
        architectures.of(varying)


@pytest.mark.parametrize("model_type", ["mamba", "mamba2", "rwkv"])
def test_a_model_without_attention_layers_is_refused_with_the_reason(model_type):
    """A pure state-space or recurrent model has no attention heads for the plan to read: refused before anything is
    built, naming the family, instead of an AttributeError from inside the plan."""
    with pytest.raises(ConfigError, match=rf"{model_type}: its config names no attention heads or decoder layers"):
        architectures.of(AutoConfig.for_model(model_type))


def test_compiled_layers_without_fp8_follow_each_mixtures_measurement(monkeypatch, caplog):
    """`compile_decoder_layers: auto` without FP8 on a GPU: on for GLM-4-MoE and Qwen3-MoE (measured exact and
    faster on the H200 / H100), off for Gemma 4's MoE (a NaN gradient at the first step), Qwen3.5-MoE (no step within
    130 s of compiling) and gpt-oss (Inductor's backward fails), each with its measurement as the logged reason; off
    everywhere without a GPU (the compile costs more than a CPU-sized run)."""
    from types import SimpleNamespace

    from sft.plan import kernels as family_kernels

    args = SimpleNamespace(auto_settings={"compile_decoder_layers"}, use_liger_kernel=False,
                           compile_decoder_layers=False)  # fmt: skip
    archs = {n: architectures.of(config_of(n)) for n in ("glm4_moe", "qwen3_moe", "gemma4_moe", "gpt_oss")}
    archs["qwen3_5_moe"] = architectures.of(
        AutoConfig.for_model(
            "qwen3_5_moe_text", num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]
        )
    )
    assert not any(family_kernels.compiled(args, a, False) for a in archs.values()) or torch.cuda.is_available()
    monkeypatch.setattr(family_kernels, "on_gpu", lambda: True)  # as on a GPU
    on = {n for n, a in archs.items() if family_kernels.compiled(args, a, False)}
    assert on == {"glm4_moe", "qwen3_moe"}
    reasons = {n: family_kernels.compile_reason(args, a, False) for n, a in archs.items()}
    assert reasons["glm4_moe"].startswith("1.25x the eager layers' tokens/s at 8 layers of GLM-4-MoE's widths")
    assert "NaN gradient norm at the first step" in reasons["gemma4_moe"]
    assert "not finished one step after 130 s" in archs["qwen3_5_moe"].kernel("compile_bf16").reason
    assert "wrong number of dimensions" in archs["gpt_oss"].kernel("compile").reason
    # asked for by name: kept, the measurement against them in the warning; none where they were measured good
    asked = SimpleNamespace(auto_settings=set(), use_liger_kernel=False, compile_decoder_layers=True, fp8=False)
    for name, said in (
        ("gemma4_moe", "NaN gradient norm"),
        ("gpt_oss", "wrong number of dimensions"),
        ("glm4_moe", None),
    ):
        with caplog.at_level(logging.WARNING, logger=family_kernels.logger.name):
            caplog.clear()
            family_kernels.family_liger(asked, archs[name])
        warned = [r.getMessage() for r in caplog.records if "compile_decoder_layers: true" in r.getMessage()]
        assert (warned and said in warned[0] and "kept as asked" in warned[0]) if said else not warned, (name, warned)


@pytest.mark.parametrize("family", ["gemma4", "gemma4_moe"])
def test_liger_beside_compiled_layers_is_never_run_where_the_pair_trained_a_wrong_loss(family, monkeypatch):
    """Gemma 4: Liger's patch under compiled decoder layers trained a wrong loss on the H200 (KERNELS'
    `liger_compiled`). With `compile_decoder_layers: auto` the layers stay eager beside Liger, with the reason; both
    asked for by name is refused naming the pair and the fix; without Liger the family's compiled layers stay on. Llama
    (the pair measured exact) keeps both."""
    from types import SimpleNamespace

    from sft.plan import kernels as family_kernels

    monkeypatch.setattr(family_kernels, "on_gpu", lambda: True)  # as on a GPU
    gemma, llama = architectures.of(config_of(family)), architectures.of(AutoConfig.for_model("llama"))

    def args(liger, compiled="auto"):
        auto = {"compile_decoder_layers"} if compiled == "auto" else set()
        return SimpleNamespace(auto_settings=auto, use_liger_kernel=liger, compile_decoder_layers=compiled is True)

    assert family_kernels.compiled(args(False), gemma, False) is (family == "gemma4")  # NaN on the MoE's GPU run
    assert family_kernels.compiled(args(True), gemma, False) is False
    assert family_kernels.compile_reason(args(True), gemma, False).startswith(
        "off beside Liger: Liger's Gemma 4 patch"
    )
    with pytest.raises(ConfigError, match=r"use_liger_kernel: true with compile_decoder_layers: true on gemma4_text: "
                                          r"Liger's Gemma 4 patch .* Set compile_decoder_layers: false"):  # fmt: skip
        family_kernels.compiled(args(True, compiled=True), gemma, False)
    assert family_kernels.compiled(args(True, compiled=False), gemma, False) is False
    assert family_kernels.compiled(args(True), llama, True)
    assert family_kernels.compiled(args(True, compiled=True), llama, False)


def test_a_new_dense_family_is_one_record(tmp_path, capsys):
    """docs/architecture.md's steps for a new dense family, followed for transformers' Granite (not in sft's table):
    before its record it trains on the generic path (every fast path off, `known` false); with one `Family` record it
    is known, its kernels are the record's, a packed row through sft's backend equals each sample alone through
    eager, and `sft plan` ranks settings for it by the speed model. Every table is a view of the records: each view
    gains it and loses it with the record."""
    from sft.model import families
    from sft.plan import cli as plan_cli

    config = AutoConfig.for_model("granite", **BASE)
    assert not architectures.of(config).known and "not in sft's architecture table" in architectures.of(
        config).kernel("liger").reason  # fmt: skip
    try:
        architectures.register(families.Family("granite", {}, keeps=architectures.LayerKeeps()))
        arch = architectures.of(config)
        assert arch.known and arch.kernel("liger").reason == architectures.UNMEASURED
        assert arch.kernel("speed").on and architectures.LAYER_KEEPS["granite"] == architectures.LayerKeeps()
        with pytest.raises(ValueError, match="a record exists"):
            architectures.register(families.Family("granite", {}))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
        batch = packed_batch(config.vocab_size)
        ids, bounds = batch["input_ids"][0], batch["cu_seq_lens_q"].tolist()
        with torch.no_grad():
            alone = [model(input_ids=ids[None, lo:hi]).logits[0] for lo, hi in itertools.pairwise(bounds)]
            model.set_attn_implementation(resolve_attn_implementation("auto", False, arch, padding_free=True))
            packed = model(**{k: v for k, v in batch.items() if k not in ("labels", "seq_lengths")}).logits[0]
        for (lo, hi), single in zip(itertools.pairwise(bounds), alone, strict=True):
            torch.testing.assert_close(packed[lo:hi], single, atol=1e-5, rtol=1e-5)
        config.save_pretrained(tmp_path)
        flags = ["--model", str(tmp_path), "--gpus", "1", "--seq-len", "512", "--gpu-memory", "1", "--suggest"]
        assert plan_cli.main(flags) == 0
        out = capsys.readouterr().out
        assert "granite" in out and "fastest first" in out and "| 1 |" in out
    finally:
        families.FAMILIES.pop("granite", None)
        architectures.KERNELS.pop("granite", None)
        architectures.LAYER_KEEPS.pop("granite", None)
    assert not architectures.of(config).known


def test_the_shipped_configs_are_the_records_ids():
    """The hub ids `sft plan` plans offline (sft/model/model_configs.json) are each listed by exactly the record of
    their model_type, and every id a record lists is shipped; every family of the tiny models has a record in sft's
    table (a record, not a row in several tables)."""
    import json
    from pathlib import Path

    from sft.model import families, shapes

    shipped = {k: v for k, v in json.loads(Path(shapes.SHIPPED_CONFIGS).read_text()).items() if not k.startswith("_")}
    listed = {hub_id: f.model_type for f in families.FAMILIES.values() for hub_id in f.shipped}
    assert listed == {hub_id: config["model_type"] for hub_id, config in shipped.items()}
    for name in FAMILIES:
        record = families.FAMILIES[config_of(name).model_type]
        assert record.kernels is not None, name

"""An image+text run's plan and model, in-process on the shipped demo (recipes/demo-vlm.yaml): the plan's vision line
and what it changes for TRL's trainer, the model built with the M-RoPE positions joined, the vision encoder frozen and
no cache in the text model; what cannot be honoured is refused before any work."""

from __future__ import annotations

import pytest
import torch

from sft.errors import ConfigError
from tests.conftest import ROOT
from tests.tiny_models import BASE, FAMILIES, sample, tiny

RECIPE = str(ROOT / "recipes" / "demo-vlm.yaml")


def planned(tmp_path, *extra):
    from sft.plan.arguments import parse_args
    from sft.plan.preflight import preflight

    config = next((extra[i + 1] for i, x in enumerate(extra) if x == "--config"), RECIPE)
    rest = [x for i, x in enumerate(extra) if x != "--config" and (i == 0 or extra[i - 1] != "--config")]
    _, data_args, args, model_args = parse_args(["--config", config, "--output_dir", str(tmp_path / "o"), *rest])
    return preflight(args, model_args, sources=data_args.datasets), data_args, model_args


def test_an_image_text_run_is_planned_built_and_packed_exactly(tmp_path):
    import datasets
    from transformers import AutoImageProcessor, AutoTokenizer

    from sft.data import vision
    from sft.model.build import load_model

    plan, _, model_args = planned(tmp_path)
    assert plan.vision == vision.Plan(assistant_only=True, train_tower=False)
    args = plan.training_args
    assert not args.packing and not args.assistant_only_loss  # sft.data.vision packs and labels the rows
    assert args.dataset_kwargs["skip_prepare_dataset"] and not args.remove_unused_columns
    model = load_model(model_args, plan).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert model.config.use_cache is False and model.config.text_config.use_cache is False  # a cache drops the mask
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".visual." in f".{n}" and "merger" not in n for n in frozen)
    assert all(p.requires_grad for n, p in model.named_parameters() if "merger" in n)

    demo = ROOT / "recipes" / "demo-vlm"
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    processor = AutoImageProcessor.from_pretrained(demo / "model")
    source = demo / "data" / "eval.parquet"
    records = datasets.load_dataset("parquet", data_files=str(source), split="train").select(range(5))
    images = vision.Images(model.config, tokenizer, processor)
    samples = [vision.encode(r, tokenizer, images, source.parent) for r in records]
    batch = vision.MRopePacker(model)(samples)
    image = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    with torch.no_grad():  # through the model as built for the run: its hook joins the positions; sdpa, no cache
        logits = model(**batch).logits[0]
        start = 0
        for s in samples:
            alone = model(input_ids=s.input_ids[None], pixel_values=s.pixel_values, image_grid_thw=s.image_grid_thw,
                          mm_token_type_ids=(s.input_ids == image).int()[None]).logits[0]  # fmt: skip
            assert torch.allclose(logits[start : start + len(alone)], alone, rtol=0, atol=1e-5)
            start += len(alone)


def test_a_trained_encoder_is_planned_with_the_activations_it_leaves_out_said(tmp_path, caplog):
    """`train_vision_tower: true` plans the encoder's states as trained weights and says that its activations are not
    counted; a frozen encoder's run says nothing of it."""
    import logging

    with caplog.at_level(logging.WARNING, logger="sft.plan"):
        planned(tmp_path, "--train_vision_tower", "true")
    assert "not yet its activations" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sft.plan"):
        planned(tmp_path)
    assert "not yet its activations" not in caplog.text


def test_an_image_text_run_without_packing_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"`qwen2_5_vl` trains on image\+text chats packed into rows"):
        planned(tmp_path, "--packing", "false")


def test_the_memory_plan_counts_no_gradient_or_optimizer_state_for_a_frozen_encoder():
    """The plan's model states of a vision-language model: with the encoder frozen (the default) its weights are held
    in 16 bits with no gradient and no optimizer state; trained, they cost what every trained weight costs. The
    frozen count is exactly the weights the run freezes."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from sft import engines
    from sft.model import architectures
    from sft.model.shapes import load_shape
    from sft.plan import memory

    model_dir = str(ROOT / "recipes" / "demo-vlm" / "model")
    frozen, trained = load_shape(model_dir, frozen_vision=True), load_shape(model_dir, frozen_vision=False)
    encoder = sum(p.numel() for _, p in architectures.vision_tower_parameters(
        AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir))))  # fmt: skip
    assert frozen.frozen_params == encoder > 0 and trained.frozen_params == 0
    assert trained.trainable() - frozen.trainable() == encoder
    for stage in (0, 2, 3):
        s = memory.Setting(gpus=2, zero_stage=stage, micro_batch=1, seq_len=256)
        saved = memory.model_states(trained, s)[0] - memory.model_states(frozen, s)[0]
        equations = [engines.model_states(shape.trainable(), shape.largest_module_params, 2, 1, stage, False, False)
                     for shape in (trained, frozen)]  # fmt: skip
        # DeepSpeed's equations for ZeRO-2/3; without ZeRO the plan's own: 16-bit weights and gradients, fp32 states
        equations = [e[0] if e else (4 + s.state_bytes) * shape.trainable()
                     for e, shape in zip(equations, (trained, frozen), strict=True)]  # fmt: skip
        held = encoder * s.dtype_bytes / (s.gpus if stage == 3 else 1)  # ZeRO-3 partitions the frozen weights too
        assert saved == pytest.approx(equations[0] - equations[1] - held, rel=1e-9), stage
        assert saved > encoder * 2, stage  # at least the gradients' 16 bits a frozen weight does not have


def test_image_text_runs_take_fsdp2_when_asked_and_auto_weighs_it_against_zero3(tmp_path, monkeypatch, caplog):
    """`engine: fsdp2` runs an image+text model (trained as under ZeRO-2: tests/multiproc/test_vision_runs.py), and
    `engine: auto` under ZeRO-3 on a GPU weighs FSDP2 against ZeRO-3 by the speed model as for a text model (measured
    on GPUs: benchmarks/results/vlm_engines), saying both estimates."""
    import logging

    from sft.plan import search

    assert planned(tmp_path, "--engine", "fsdp2", "--deepspeed", "none")[0].engine.name == "fsdp2"
    monkeypatch.setattr(search, "gpu_name", lambda: "NVIDIA H200")
    with caplog.at_level(logging.INFO, logger="sft.plan"):
        plan, _, _ = planned(tmp_path, "--deepspeed", "ds_configs/zero3.json", "--plan_gpu_memory_gib", "139.8")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine: auto -> ")]
    assert len(said) == 1 and "FSDP2" in said[0] and "DeepSpeed ZeRO-3" in said[0] and "estimated" in said[0], said
    assert plan.engine.name == said[0].split()[3], said  # the engine the line names is the one the run takes
    assert "not measured" not in said[0] and "benchmarks/results/vlm_engines" in said[0]


def test_sft_plan_counts_a_vision_models_encoder_frozen_as_a_run_does(capsys, tmp_path):
    """`sft plan` on Qwen2.5-VL-7B's widths (2 decoder layers; the config only): the encoder frozen unless
    `--train-vision-tower`, as in a run: less optimizer state, the same 16-bit weights."""
    from benchmarks.vlm import make_model
    from sft.plan.cli import main

    model = str(make_model(tmp_path, 2, tiny=False))
    common = ["--model", model, "--gpus", "1", "--zero", "none", "--micro-batch", "1", "--seq-len", "256",
              "--gpu-memory", "80"]  # fmt: skip
    assert main(common) == 0
    frozen = capsys.readouterr().out
    assert main([*common, "--train-vision-tower"]) == 0
    trained = capsys.readouterr().out
    assert "in the frozen vision encoder)" in frozen and "frozen vision encoder" not in trained

    def line(out: str, name: str) -> float:
        return float(next(x for x in out.splitlines() if x.strip().startswith(name)).split()[-2])

    # 0.632B encoder weights x the optimizer's bytes a weight: no DeepSpeed, bf16 weights stepped in place with 8-bit
    # moments (`optim: auto`: 2 + 8/256 bytes, 1.20 GiB); under ZeRO-2 an fp32 master and fp32 moments (12 bytes)
    assert line(trained, "optimizer") - line(frozen, "optimizer") == pytest.approx(1.20, abs=0.02)
    assert main([*common[:5], "2", *common[6:], "--train-vision-tower"]) == 0
    zero2 = capsys.readouterr().out
    assert main([*common[:5], "2", *common[6:]]) == 0
    assert line(zero2, "optimizer") - line(capsys.readouterr().out, "optimizer") == pytest.approx(7.06, abs=0.02)
    assert line(frozen, "weights") == line(trained, "weights")
    assert main([*common, "--suggest", "--same-stage"]) == 0  # ranked by the speed model, as every family (#65)
    ranking = capsys.readouterr().out
    assert "fastest first" in ranking and "not fitted" not in ranking and "| 1 | no DeepSpeed" in ranking


def test_gemma3_is_an_image_text_run_on_image_data_and_a_text_run_on_text(tmp_path, caplog):
    """A `gemma3` config (which Gemma 3's checkpoints are, text fine-tuning included) on the demo's image chats: an
    image+text run packed by sft's masks on sdpa, its SigLIP encoder frozen and its projector trained, and the model
    as built (the masks' hook on it) gives a packed row of the demo's records its samples' logits alone; on the text
    demo's data a text run; a backend that cannot read the masks refused before any work."""
    import datasets
    from transformers import AutoImageProcessor, AutoTokenizer

    from sft.data import vision
    from sft.model.build import load_model
    from sft.tools import demo_vlm

    model_dir = demo_vlm.write_model(tmp_path / "gemma3", "gemma3")
    with caplog.at_level("INFO"):
        plan, _, model_args = planned(tmp_path, "--model_name_or_path", str(model_dir))
    assert plan.vision == vision.Plan(assistant_only=True, train_tower=False, packing="masks")
    assert plan.attn_implementation == "sdpa" and "gemma3: image+text data" in caplog.text
    assert plan.kernels["Liger"].reason == "measured on text rows only, not on image+text runs"  # gemma3_text's is on
    torch.manual_seed(0)
    model = load_model(model_args, plan).eval()
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".vision_tower." in f".{n}" for n in frozen)
    assert all(p.requires_grad for n, p in model.named_parameters() if "multi_modal_projector" in n)
    tokenizer, processor = AutoTokenizer.from_pretrained(model_dir), AutoImageProcessor.from_pretrained(model_dir)
    source = ROOT / "recipes" / "demo-vlm" / "data" / "eval.parquet"
    records = datasets.load_dataset("parquet", data_files=str(source), split="train").select(range(5))
    images = vision.Images(model.config, tokenizer, processor)
    samples = [vision.encode(r, tokenizer, images, source.parent) for r in records]
    assert all(int((s.input_ids == model.config.image_token_id).sum()) == 4 for s in samples)
    with torch.no_grad():  # through the model as built for the run: its hook gives the row sft's masks
        packed = model(**vision.packer(model)(samples)).logits[0]
        start = 0
        for s in samples:
            types = (s.input_ids == model.config.image_token_id).long()[None]
            alone = model(input_ids=s.input_ids[None], token_type_ids=types, pixel_values=s.pixel_values).logits[0]
            n = len(s.input_ids)
            assert torch.allclose(packed[start : start + n], alone, rtol=0, atol=1e-5), start
            start += n

    text, _, _ = planned(tmp_path, "--config", str(ROOT / "recipes" / "demo.yaml"), "--model_name_or_path",
                         str(model_dir))  # fmt: skip
    assert text.vision is None and text.training_args.packing  # TRL's packing of text rows, sft's text path
    with pytest.raises(ConfigError, match="`attn_implementation: flash_attention_2` with image\\+text `gemma3`.*sdpa"):
        planned(tmp_path, "--model_name_or_path", str(model_dir), "--attn_implementation", "flash_attention_2")


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_a_frozen_encoder_under_checkpointing_keeps_nothing_and_gets_no_backward(family):
    """transformers' activation checkpointing makes every sub-model's input embeddings require grad, the frozen
    encoder's too: its blocks then keep their inputs and run again and backwards for no gradient. Frozen by sft
    (`sft.model.converters`), the encoder under checkpointing keeps what it keeps without checkpointing (its
    projector's inputs) and the loss and every trained weight's gradient are those of the encoder as transformers
    leaves it."""
    import gc
    import weakref

    from sft.data import vision
    from sft.model import architectures, converters, vision_hooks

    def run(freeze_with_sft: bool, checkpointing: bool):
        model = tiny(family).train()
        if freeze_with_sft:
            converters._freeze_vision_tower(model, None)
        else:
            for _, param in architectures.vision_tower_parameters(model):
                param.requires_grad_(False)
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        gen, patch = torch.Generator().manual_seed(1), model.config.vision_config.patch_size
        samples = [sample(gen, 5, (1, 8, 12), 7, 6 * patch**2), sample(gen, 3, (1, 8, 4), 11, 6 * patch**2)]
        batch = vision.MRopePacker(model)(samples)
        vision_hooks.join_positions(model)
        encoder, inside, saved = architectures.vision_encoder(model), [], {}
        encoder.register_forward_pre_hook(lambda m, a: inside.append(m) or None)
        encoder.register_forward_hook(lambda m, a, o: inside.clear() or None)

        def pack(t):  # what the encoder saves, and whether the backward holds it (a weak reference still alive)
            if inside:
                saved[t.untyped_storage().data_ptr()] = (t.untyped_storage().nbytes(), weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(**batch, use_cache=False)
        gc.collect()
        kept = sum(n for n, alive in saved.values() if alive() is not None)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        return out.loss, grads, kept

    loss, grads, kept = run(True, True)
    plain_loss, plain_grads, plain_kept = run(False, True)
    _, _, without_checkpointing = run(True, False)
    assert kept == without_checkpointing  # the projector's inputs, nothing of the frozen blocks
    if family != "qwen3_vl":  # Qwen3-VL's encoder has no input embeddings transformers finds: never in the backward
        assert plain_kept > kept
    assert torch.equal(loss, plain_loss) and grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)


@pytest.mark.parametrize("family", ["gemma4", "qwen3_5"])
def test_the_newer_image_text_configs_train_on_text_and_on_images(tmp_path, family):
    """Gemma 4's and Qwen3.5's checkpoints are image+text configs. On the text demo's records: a text run of their
    text model (gemma4_text, packed exactly: tests/test_architectures.py; qwen3_5_text's linear attention one sample at
    a time: tests/test_linear_attention.py). On the image demo's records: an image+text run of the image+text class,
    Qwen3.5 packed by its M-RoPE rows on `auto`'s backend (sft_varlen on the CPU too), Gemma 4 by sft's masks on sdpa
    (both exact: tests/test_vision_packing.py); Gemma 4's audio encoder (no audio row is built) frozen and counted
    frozen by the memory plan."""
    from transformers import AutoConfig

    from sft.model import shapes
    from sft.model.build import load_model

    text = {
        "gemma4": {**FAMILIES["gemma4"][1], "model_type": "gemma4_text"},
        "qwen3_5": {"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"] * 2},
    }
    vision = {
        "gemma4": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                   "num_key_value_heads": 2, "head_dim": 16},
        "qwen3_5": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64},
    }  # fmt: skip
    audio = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "output_proj_dims": 32}
    extra = {"audio_config": audio} if family == "gemma4" else {}
    config = AutoConfig.for_model(family, text_config={**BASE, **text[family]}, vision_config=vision[family], **extra)
    config.save_pretrained(tmp_path / family)
    plan, _, _ = planned(tmp_path, "--config", str(ROOT / "recipes" / "demo.yaml"), "--model_name_or_path",
                         str(tmp_path / family))  # fmt: skip
    assert plan.vision is None and plan.arch.family == f"{family}_text" and plan.training_args.packing
    if family == "gemma4":  # the text run builds the audio encoder too (transformers' class for the config): frozen
        text_model = load_model(planned(tmp_path, "--config", str(ROOT / "recipes" / "demo.yaml"),
                                        "--model_name_or_path", str(tmp_path / family))[2], plan)  # fmt: skip
        assert not any(p.requires_grad for n, p in text_model.named_parameters() if "audio" in n)
    images, _, model_args = planned(tmp_path, "--model_name_or_path", str(tmp_path / family))
    packing = {"gemma4": "masks", "qwen3_5": "mrope"}[family]
    backend = {"gemma4": "sdpa", "qwen3_5": "sft_varlen"}[family]  # sft's masks need sdpa; M-RoPE rows take auto's
    assert images.vision is not None and images.vision.packing == packing and images.attn_implementation == backend
    model = load_model(model_args, images)  # the image+text class (its causal-LM class is the text model alone)
    assert type(model).__name__ == {"gemma4": "Gemma4", "qwen3_5": "Qwen3_5"}[family] + "ForConditionalGeneration"
    if family == "qwen3_5":
        layers = [m for m in model.modules() if type(m).__name__ == "Qwen3_5GatedDeltaNet"]
        assert len(layers) == 2 and all(m.forward.__name__ == "forward" and hasattr(m.forward, "__wrapped__")
                                        for m in layers)  # fmt: skip
        return
    audio_tower = [p for n, p in model.named_parameters() if "audio" in n]
    assert audio_tower and not any(p.requires_grad for p in audio_tower)
    assert all(p.requires_grad for n, p in model.named_parameters() if "language_model" in n or "embed_vision" in n)
    frozen = shapes.load_shape(str(tmp_path / family), config=images.model_config, arch=images.arch,
                               frozen_vision=True).frozen_params  # fmt: skip
    tower = sum(p.numel() for n, p in model.named_parameters() if ".vision_tower." in f".{n}")
    assert frozen == sum(p.numel() for p in audio_tower) + tower


def test_an_image_text_config_sft_does_not_pack_is_refused_on_image_data_before_any_work(tmp_path):
    """A multimodal config outside sft's image+text table (LLaVA) trains on text records; on image records it is
    refused before any work, naming the family and the families sft packs."""
    from transformers import AutoConfig

    AutoConfig.for_model("llava", text_config={**BASE, "model_type": "llama"}).save_pretrained(tmp_path / "llava")
    with pytest.raises(ConfigError, match="llava is an image\\+text model, and the data's records hold images: sft "
                       "trains llava on text only so far .*image\\+text families: gemma3, gemma4, "):  # fmt: skip
        planned(tmp_path, "--model_name_or_path", str(tmp_path / "llava"))

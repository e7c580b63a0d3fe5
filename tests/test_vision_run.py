"""An image+text run's plan and model, in-process on the shipped demo (recipes/demo-vlm.yaml): the plan's vision line
and what it changes for TRL's trainer, the model built with the M-RoPE positions joined, the vision encoder frozen and
no cache in the text model; what cannot be honoured is refused before any work."""

from __future__ import annotations

import pytest
import torch

from sft.errors import ConfigError
from tests.conftest import ROOT

RECIPE = str(ROOT / "recipes" / "demo-vlm.yaml")


def planned(tmp_path, *extra):
    from sft.config import parse_args
    from sft.plan.preflight import preflight

    _, data_args, args, model_args = parse_args(["--config", RECIPE, "--output_dir", str(tmp_path / "o"), *extra])
    return preflight(args, model_args), data_args, model_args


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
    samples = [vision.encode(r, tokenizer, processor, source.parent) for r in records]
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


def test_an_image_text_run_without_packing_is_refused_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match=r"`qwen2_5_vl` trains on image\+text chats packed into rows"):
        planned(tmp_path, "--packing", "false")

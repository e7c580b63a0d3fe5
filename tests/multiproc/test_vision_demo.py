"""README's vision-language demo, as the README walk ran it (`sft train --nproc-per-node 2 --config
recipes/demo-vlm.yaml`, then `python -m sft.tools.demo_vlm --evaluate outputs/demo-vlm`): the loss falls, the trained
model names the colour of the held-out shapes where the untrained model names none, and its output directory loads
and generates on its own (the image processor saved beside it)."""

from __future__ import annotations

import re

import torch

from tests.conftest import ROOT, read_jsonl


def test_the_vision_demo_learns_to_name_the_colour_of_held_out_shapes(readme_walk, tmp_path):
    from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    from sft.tools import demo_vlm

    step = next((s for s in readme_walk.steps if "demo_vlm --evaluate" in s.what), None)
    assert step is not None and step.result.returncode == 0, "README's vision demo did not run (see test_readme.py)"
    said = re.findall(r"(\w+): (\d+)% answered exactly", step.result.stdout)
    shares = {kind: int(share) / 100 for kind, share in said}
    out = readme_walk.root / "outputs" / "demo-vlm"
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert sum(losses[-3:]) < 0.1 * sum(losses[:3]), losses
    assert (out / "preprocessor_config.json").is_file()

    model_dir = ROOT / "recipes" / "demo-vlm" / "model"
    torch.manual_seed(0)
    untrained = tmp_path / "untrained"
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(model_dir)).save_pretrained(untrained)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(untrained)
    AutoImageProcessor.from_pretrained(model_dir).save_pretrained(untrained)
    before = demo_vlm.evaluate(untrained, ROOT / "recipes" / "demo-vlm" / "data" / "eval.parquet", limit=40)
    assert shares["colour"] >= 0.9 > before["colour"] + 0.5, (shares, before)

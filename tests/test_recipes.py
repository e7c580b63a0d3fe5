"""Every shipped model recipe (`recipes/<model>/sft/*.yaml`, the alignment-handbook layout) says the GPUs it was
planned for and what `sft plan` answers for it; this test plans each again from the recipe's own fields and holds the
comment to the answer (a recipe whose plan no longer fits, or whose figures moved, fails here)."""

from __future__ import annotations

import re

import pytest
import yaml

from sft.plan import cli as plan_cli
from tests.conftest import ROOT

RECIPES = sorted(ROOT.glob("recipes/*/sft/*.yaml"))
PLANNED = re.compile(r"^# Planned for (\d+) x H100 80GB", re.M)
ANSWER = re.compile(r"^#   -> (.+): peak ([\d.]+) GiB", re.M)
H100_GIB = "79.18"  # what torch reports for an H100 80GB HBM3


def plan_args(recipe) -> list[str]:
    """`sft plan`'s arguments for a recipe: its model, rows, global batch, ZeRO stage, LoRA/QLoRA, the GPUs of its
    `Planned for` line, an H100's memory, the settings of its own stage ranked as `sft train` ranks them."""
    text = recipe.read_text()
    fields = yaml.safe_load(text)
    stage = re.search(r"zero(\d)", fields["deepspeed"]).group(1)
    args = ["--model", fields["model_name_or_path"], "--gpus", PLANNED.search(text).group(1), "--zero", stage,
            "--seq-len", str(fields["max_length"]), "--global-batch", str(fields["global_batch_size"]),
            "--gpu-memory", H100_GIB, "--host-memory", "1000", "--suggest", "--same-stage", "--top", "1"]  # fmt: skip
    if fields.get("use_peft"):
        args += ["--lora-r", str(fields["lora_r"]), "--lora-dropout", str(fields.get("lora_dropout", 0.0))]
        args += ["--qlora"] if fields.get("load_in_4bit") else []
    return args


def planned(recipe, capsys) -> tuple[str, float]:
    """(the first setting of `sft plan`'s ranking, its peak GiB) for the recipe."""
    plan_cli.main(plan_args(recipe))
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # every family's ranking carries the speed model's estimate (issue #65: no "not fitted on this family")
    assert float(cells[2].replace(",", "")) > 0 and cells[3].endswith("%"), row
    return cells[1], float(cells[-1])


def test_every_model_in_the_issue_ships_a_recipe():
    names = {p.parent.parent.name for p in RECIPES}
    assert names >= {"llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "gemma-3-12b", "gpt-oss-20b", "mistral-7b",
                     "llama-3.1-70b"}  # fmt: skip
    assert (ROOT / "recipes" / "llama-3.1-70b" / "sft" / "config_lora.yaml").is_file()


@pytest.mark.parametrize("recipe", [r for r in RECIPES if ANSWER.search(r.read_text())],
                         ids=lambda p: str(p.relative_to(ROOT)))  # fmt: skip
def test_a_recipe_plans_to_what_its_comment_says(recipe, capsys):
    setting, peak = planned(recipe, capsys)
    said, said_peak = ANSWER.search(recipe.read_text()).groups()
    assert (setting, peak) == (said, float(said_peak)), "run the recipe's `sft plan` line and update its comment"
    assert peak <= float(H100_GIB) * 0.9  # fits what an H100 leaves usable


def test_every_new_recipe_says_its_gpus_and_plan():
    for recipe in RECIPES:
        if recipe.parent.parent.name == "llama-3.1-8b" and recipe.stem == "config_long":
            continue  # measured on 2 x H200 with sequence parallelism: its comment gives those figures
        text = recipe.read_text()
        assert PLANNED.search(text) and ANSWER.search(text), recipe

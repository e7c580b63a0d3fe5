"""`sft data` on the demo recipe against a direct count over the tokenised records, and `sft report`'s and
`sft data`'s errors (in-process)."""

from __future__ import annotations

import json
import statistics

import pytest
from transformers import AutoTokenizer
from trl.chat_template_utils import get_training_chat_template

from sft.data import stats as datastats
from sft.tools import report
from tests.conftest import ROOT, read_jsonl
from tests.helpers import demo_args

RECIPE = str(ROOT / "recipes" / "demo.yaml")


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "stats.json"
    assert datastats.main([RECIPE, "--gpus", "2", "--json", str(out)]) == 0
    return json.loads(out.read_text())[-1]  # the total


def test_sft_data_equals_a_direct_count(figures):
    """Lengths and trained tokens equal the chat template applied record by record (the training template's
    assistant masks for the trained tokens); no record is longer than max_length, so the packer keeps every token."""
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "recipes" / "demo" / "model")
    template = get_training_chat_template(tokenizer) or tokenizer.chat_template
    lengths, trained = [], []
    for record in read_jsonl(ROOT / "recipes" / "demo" / "data" / "train.jsonl"):
        enc = tokenizer.apply_chat_template(record["messages"], chat_template=template, tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)  # fmt: skip
        lengths.append(len(enc["input_ids"]))
        trained.append(sum(enc["assistant_masks"]))
    assert figures["records"] == len(lengths) == 6000
    assert figures["tokens"] == sum(lengths)
    assert figures["trained_tokens"] == sum(trained)
    d = figures["length"]
    assert (d["min"], d["p50"], d["max"]) == (min(lengths), statistics.median(lengths), max(lengths))
    assert sum(figures["length_histogram"]["counts"]) == len(lengths)
    assert figures["over_max_length"] == sum(n > 512 for n in lengths) == 0
    assert figures["packed_tokens"] == sum(lengths)
    assert figures["packing_efficiency"] == pytest.approx(sum(lengths) / (figures["packed_rows"] * 512))
    assert figures["packed_rows"] >= sum(lengths) / 512


def test_sft_data_steps_per_epoch_match_the_demo(figures):
    """README's demo: 2 processes, micro batch 2, 5 epochs in 325 optimizer steps: 65 per epoch."""
    assert figures["global_batch_rows"] == 4
    assert figures["steps_per_epoch"] == 65


def test_sft_data_prints_the_figures_and_a_histogram(capsys, figures):
    assert datastats.main([RECIPE, "--max_length", "20"]) == 0
    out = capsys.readouterr().out
    over = figures["records"] - figures["length_histogram"]["counts"][0]  # at least the lengths above 20 tokens
    assert "longer than max_length 20:" in out and "cut at max_length by the packer" in out
    assert int(out.split("longer than max_length 20: ")[1].split(" ")[0].replace(",", "")) <= over
    assert "records by tokens per record:" in out and "#" in out
    assert "optimizer steps per epoch at a global batch of 2 rows" in out


def test_sft_data_bad_recipe_is_one_clear_error(tmp_path, capsys):
    assert datastats.main([str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "nope.yaml" in err and "Traceback" not in err


def test_sft_report_without_metrics_is_one_clear_error(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"`{tmp_path}` has no metrics.jsonl: not an sft run directory" in err
    assert report.main([str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert report.main([str(tmp_path)]) == 2
    assert "metrics.jsonl: line 2 is not JSON" in capsys.readouterr().err


def test_sft_report_does_not_replace_a_page_it_did_not_write(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "time": 1.0, "loss": 2.0}\n')
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "index.html").write_text("<html>mine</html>")
    assert report.main([str(tmp_path)]) == 2
    assert "exists and sft did not write it" in capsys.readouterr().err
    assert (tmp_path / "report" / "index.html").read_text() == "<html>mine</html>"


def test_training_skips_the_figures_for_streamed_data(tmp_path):
    """A streamed source is not read through at the start (nor data TRL does not prepare); training says why."""
    import datasets

    from sft.plan.preflight import preflight

    _, _, args, model_args = demo_args(tmp_path, "--output_dir", str(tmp_path / "out"))
    streamed = datasets.load_dataset("json", data_files=str(ROOT / "recipes/demo/data/train.jsonl"), split="train",
                                     streaming=True)  # fmt: skip
    assert datastats.for_training(streamed, None, preflight(args, model_args)) is None
    assert "streamed" in datastats.skipped(streamed, args)


def test_sft_data_takes_the_recipe_as_config_too(figures, tmp_path):
    """`sft data --config RECIPE` (issue #78: "Some specified arguments are not used") gives the positional form's
    figures."""
    out = tmp_path / "stats.json"
    assert datastats.main(["--config", RECIPE, "--gpus", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())[-1] == figures

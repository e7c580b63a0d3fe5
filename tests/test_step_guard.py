"""The non-finite guard's decisions and records, the zero-loss warning and the settings that would defeat them
(`sft.run.failsafe`), in-process; the runs through the CLI are in tests/multiproc/test_failsafe.py."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from sft.errors import ConfigError
from sft.plan.arguments import parse_args
from sft.run import failsafe
from sft.run.checkpoint import RUN_MANIFEST
from tests.conftest import ROOT, read_jsonl

DEMO = ["--config", str(ROOT / "recipes" / "demo.yaml"), "--deepspeed", "none"]


def _args(tmp_path, *extra: str):
    return parse_args([*DEMO, "--output_dir", str(tmp_path), *extra])[2]


def test_the_guard_skips_steps_below_the_limit_and_stops_at_it(tmp_path, caplog):
    """max_nonfinite_steps 3: a finite step passes; a NaN loss and then an infinite gradient norm are skipped, each
    with a warning and a metrics.jsonl line; the third non-finite step raises with the skipped steps named, and the
    stop is recorded in metrics.jsonl and sft_run.json."""
    args = _args(tmp_path, "--max_nonfinite_steps", "3")
    guard = failsafe.StepGuard(args)
    identity = lambda t: t  # noqa: E731  (one process: the sum over ranks is the tensor)
    guard.add(torch.tensor(2.5))
    assert guard.check(1, 1.25, identity) is False
    guard.add(torch.tensor(2.5))
    guard.add(torch.tensor(float("nan")))  # one micro-batch of the step is enough
    with caplog.at_level(logging.WARNING, logger="sft.run.failsafe"):
        assert guard.check(2, 1.0, identity) is True
        guard.add(torch.tensor(2.5))
        assert guard.check(3, float("inf"), identity) is True
    assert (
        "step 2 was not finite (a non-finite loss on this rank, gradient norm 1.0; 1 of 1 rank(s) saw it): "
        "skipped, not applied to the weights (non-finite step 1; the run stops at non-finite step 3" in caplog.text
    )
    assert "step 3 was not finite (a finite loss on this rank, gradient norm inf" in caplog.text
    guard.add(torch.tensor(2.5))
    with pytest.raises(failsafe.NonFiniteStep) as stopped:
        guard.check(4, float("nan"), identity)
    message = str(stopped.value)
    assert message.startswith("step 4 was not finite (a finite loss on this rank, gradient norm nan; 1 of 1 rank(s)")
    assert "the run stopped there, the step not applied. Skipped before it: steps 2, 3." in message
    assert "No checkpoint was complete before it." in message and "learning rate" in message
    events = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(e["step"], e.get("nonfinite_skipped"), e.get("stopped")) for e in events] == [
        (2, 1, None), (3, 2, None), (4, None, "non-finite"),
    ]  # fmt: skip
    manifest = json.loads((tmp_path / RUN_MANIFEST).read_text())
    assert manifest["stopped"]["step"] == 4 and manifest["stopped"]["message"] == message


def test_a_loss_of_exactly_zero_at_three_logs_in_a_row_is_warned_about_once(caplog):
    watch = failsafe.ZeroLoss()
    with caplog.at_level(logging.WARNING, logger="sft.run.failsafe"):
        for step, loss in enumerate([0.0, 0.0, 1.5, 0.0, 0.0], start=1):
            watch.log(step, loss)
        assert "exactly 0.0" not in caplog.text  # two in a row, then two: no warning
        for step in (6, 7, 8):
            watch.log(step, 0.0)
    assert caplog.text.count("exactly 0.0 at 3 logs in a row (steps 4, 5, 6)") == 1


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_nonfinite_steps_below_one_is_refused(tmp_path, value):
    with pytest.raises(ConfigError, match=rf"`max_nonfinite_steps` is {value}: .* at least 1"):
        _args(tmp_path, "--max_nonfinite_steps", value)


def test_a_deepspeed_config_that_would_apply_non_finite_steps_is_refused(tmp_path):
    """bf16.check_grad_overflow: false makes DeepSpeed apply a NaN step; true (or absent) is DeepSpeed's check."""
    config = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    path = tmp_path / "ds.json"
    for value, refused in ((False, True), (True, False)):
        config["bf16"] = {"enabled": "auto", "check_grad_overflow": value}
        path.write_text(json.dumps(config))
        argv = [*DEMO[:2], "--deepspeed", str(path), "--output_dir", str(tmp_path / "out")]
        if refused:
            with pytest.raises(ConfigError, match=r"bf16.check_grad_overflow: false in .*ds.json lets DeepSpeed"):
                parse_args(argv)
        else:
            parse_args(argv)

"""The `sft` subcommands as a user runs them, as processes: what they print and how they leave."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, cli_env


def test_sft_data_prints_its_figures_and_leaves_without_library_noise():
    """Triton's bindings printed ~30 lines of `nanobind: leaked N instances!` at the interpreter's teardown after
    `sft data`, `sft plan`, `sft check` and `sft merge`, under their output and errors (issue #78); the `sft` command
    now leaves after its exit handlers without that teardown (`sft.cli.run`). The figures say how many records a
    short max_length leaves without an answer token."""
    result = subprocess.run(
        [sys.executable, "-m", "sft", "data", "recipes/demo.yaml", "--max_length", "16"],
        cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "nanobind" not in result.stderr and "leaked" not in result.stderr, result.stderr[-3000:]
    assert "total (the mix that trains): 6,000 records" in result.stdout
    assert "records left without an answer token (loss 0): " in result.stdout

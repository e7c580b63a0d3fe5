"""The files of a run's output directory that more than one part of sft reads: sft's claim on it (`sft_run.json`,
written by `sft.run.checkpoint`), the metrics log (`sft.run.metrics`) and the data figures (`sft.data.stats`). Here so
that `sft report` reads a run without importing the trainer's libraries."""

from __future__ import annotations

import json
from pathlib import Path

from sft.errors import ConfigError

# sft's claim on an output_dir, written by the main process before anything else there: which run made the
# directory, and at the end the step it finished at and the files of the final model. Without it nothing in the
# directory is sft's (a README.md or metrics.jsonl there is the user's), unless it holds checkpoint-N folders (runs
# from before the manifest).
RUN_MANIFEST = "sft_run.json"
METRICS_FILE = "metrics.jsonl"  # a line per logged step (sft.run.metrics)
DISCARDED_METRICS_FILE = "metrics.discarded.jsonl"  # steps an interrupted attempt logged after its last checkpoint
STATS_FILE = "data_stats.json"  # the training data's figures at the start (sft.data.stats)


def read_manifest(out: Path) -> dict | None:
    """The manifest of output directory `out`, or None where sft never claimed it; ConfigError if it is damaged."""
    path = Path(out) / RUN_MANIFEST
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is damaged ({e}); move it or the whole output_dir away.") from e

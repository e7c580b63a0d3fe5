"""The out-of-memory retry between `sft train`'s launcher, the plan and the run, and the exit codes they share: a
worker that ran out of memory with sft's micro batch writes a note and exits with `OOM_EXIT_CODE`
(`sft.run.failsafe`); the launcher reads the notes (`retry_after_oom`) and starts the run again with `RETRY_ENV`
(`sft.parallel.launch`); the plan reads it back (`Retry.from_env`) and plans at most that micro batch with the same
global batch (`sft.plan.preflight`)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

NONFINITE_EXIT_CODE = 3  # not 2 (a configuration error): the run started, then went wrong
OOM_EXIT_CODE = 76  # a worker that ran out of memory with sft's micro batch, and left its note for the retry
RETRY_ENV = "SFT_OOM_RETRY"  # from `sft train` after an out-of-memory: "<micro batch cap> <global batch>"


@dataclass(frozen=True)
class Retry:
    """What `sft train` passes to the run after an out-of-memory: the largest micro batch it may use, and the global
    batch to keep."""

    micro_cap: int
    global_batch: int

    @classmethod
    def from_env(cls) -> Retry | None:
        value = os.environ.get(RETRY_ENV)
        if not value:
            return None
        cap, global_batch = (int(v) for v in value.split())
        return cls(cap, global_batch)

    def describe(self) -> str:
        return (
            f"the run before it ran out of memory, so sft train runs it with a micro batch of at most "
            f"{self.micro_cap} and its global batch of {self.global_batch} rows"
        )


def retry_after_oom(error_dir: str) -> Retry | None:
    """The retry the workers' notes ask for (the smallest micro batch any rank asked for), or None."""
    files = list(Path(error_dir).glob("oom-rank*.json"))
    notes = [json.loads(p.read_text()) for p in files]
    for p in files:
        p.unlink()
    if not notes:
        return None
    return Retry(min(n["retry_micro"] for n in notes), notes[0]["global_batch"])

"""Runs that go wrong end as failures, with what to do next; nothing the run made is lost or written over.

- **Non-finite steps.** Before the optimizer applies a step, the step's loss (each rank's micro-batches) and
  gradient norm (global) are checked with one all-reduce. A step that is NaN or infinite on any rank is not applied:
  without DeepSpeed sft drops its gradients before `optimizer.step()`; DeepSpeed's ZeRO optimizer has already skipped
  it (its overflow check on the gradient norm, on for fp32 and, with `bf16.check_grad_overflow`, its default, for
  bf16; the DeepSpeed engine refuses that check turned off). At the `max_nonfinite_steps`th such step (default 1)
  every rank stops (exit code `NONFINITE_EXIT_CODE`, distinct from a configuration error's 2) with one paragraph:
  the figures, the newest complete checkpoint (from before the step, intact), the usual causes; the stop is in
  metrics.jsonl and sft_run.json (`stopped`), and no final model is written, so a run that diverged never ends as a
  success. A loss of exactly 0.0 at several logs in a row gets a warning (`ZeroLoss`).
- **Out of memory.** A CUDA out-of-memory error in a run whose micro batch sft chose (`per_device_train_batch_size:
  auto`) ends the worker with `OOM_EXIT_CODE` and a note of its batch; `sft train` (`sft.parallel.launch`) then runs
  the same command again with the micro batch halved and the global batch kept (twice the accumulation: the same
  samples in every optimizer step), which resumes from the newest complete checkpoint, or starts over if there is none;
  down to micro batch 1, then it stops with the levers that are left. Under torchrun or the deepspeed launcher the
  error says which flags the rerun needs. A micro batch set by hand is never changed: the error gives the plan's
  figures. The retried run writes an `out_of_memory_retry` line in metrics.jsonl at the step it starts from, and a run
  that stops out of memory a `stopped` line and sft_run.json's `stopped`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sft.core.retry import OOM_EXIT_CODE, Retry
from sft.errors import SFTError
from sft.plan import levers

logger = logging.getLogger(__name__)


class NonFiniteStep(SFTError):
    """A training step whose loss or gradient norm was not finite."""


class StepGuard:
    """Collects each micro-batch's loss of the current optimizer step (`add`, no device sync), then `check`s the
    step once, before the optimizer applies it."""

    def __init__(self, args):
        self.args = args
        self.limit = args.max_nonfinite_steps
        self.skipped: list[int] = []  # the non-finite steps skipped so far (fewer than `limit`)
        self._bad: torch.Tensor | None = None  # whether a loss of this step on this rank was not finite

    def add(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._bad = bad if self._bad is None else self._bad | bad

    def check(self, step: int, grad_norm, reduce) -> bool:
        """Whether step `step` is not finite on any rank (its loss on a rank, or the gradient norm): then it must not
        be applied (`sft.run.trainer`), and at the `limit`th such step `NonFiniteStep` is raised on every rank.
        `reduce(tensor)` sums a tensor over the ranks (one scalar all-reduce per optimizer step)."""
        args = self.args
        norm = float(grad_norm) if grad_norm is not None else 0.0
        local = self._bad is not None and bool(self._bad)
        self._bad = None
        bad = torch.tensor(float(local or not math.isfinite(norm)), device=args.device)
        ranks = int(reduce(bad).item())
        if not ranks:
            return False
        loss = "a non-finite loss on this rank" if local else "a finite loss on this rank"
        saw = f"{ranks} of {args.world_size} rank(s) saw it"
        what = f"step {step} was not finite ({loss}, gradient norm {norm}; {saw})"
        if len(self.skipped) + 1 < self.limit:
            self.skipped.append(step)
            logger.warning(
                "%s: skipped, not applied to the weights (non-finite step %d; the run stops at non-finite step %d, "
                "max_nonfinite_steps)",
                what, len(self.skipped), self.limit,
            )  # fmt: skip
            record(args, {"step": step, "nonfinite_skipped": len(self.skipped), "grad_norm": norm})
            return True
        skipped = f" Skipped before it: steps {', '.join(map(str, self.skipped))}." if self.skipped else ""
        message = (
            f"{what}: the run stopped there, the step not applied.{skipped} {_newest_checkpoint(args.output_dir)} No "
            f"final model was written. Usual causes: a learning rate too high for this model and batch (now "
            f"{args.learning_rate:g}); a fast path that is not exact for this model (the `Model:` line at the start "
            "names the FP8, Liger and compile decisions: turn the one you set by hand off); bf16 overflow in a model "
            "that needs fp32 somewhere; a data record (trace_data: true logs which rows each step trained). Change "
            "the setting, then rerun the same command: it resumes from that checkpoint (or use a new output_dir to "
            "start over)."
        )
        stop(args, step, "non-finite", message)
        raise NonFiniteStep(message)


class ZeroLoss:
    """A training loss of exactly 0.0 at `WARN_AFTER` logs in a row: a warning (an all-masked batch or a broken
    model logs 0.0 without failing)."""

    WARN_AFTER = 3

    def __init__(self):
        self.steps: list[int] = []

    def log(self, step: int, loss: float) -> None:
        self.steps = self.steps + [step] if loss == 0.0 else []
        if len(self.steps) == self.WARN_AFTER:
            logger.warning(
                "The training loss was exactly 0.0 at %d logs in a row (steps %s). A model that learned the data "
                "has a small loss, not 0.0: check that the batches have trained tokens (the labels of a chat "
                "template's assistant turns), and the grad_norm of these steps.",
                self.WARN_AFTER, ", ".join(map(str, self.steps)),
            )  # fmt: skip


def record(args, line: dict) -> None:
    """One event line in metrics.jsonl (main process), beside the training logs (`sft.run.report` shows them)."""
    if args.process_index != 0:
        return
    from sft.run.metrics import append

    append(args.output_dir, {**line, "time": time.time()})


def stop(args, step: int, reason: str, message: str) -> None:
    """The run stops at `step`: an event line in metrics.jsonl and `stopped` in sft_run.json (main process)."""
    record(args, {"step": step, "stopped": reason})
    if args.process_index != 0:
        return
    from sft.run import checkpoint as ckpt

    when = time.strftime("%Y-%m-%d %H:%M:%S")
    ckpt.update_manifest(args.output_dir, stopped={"step": step, "reason": reason, "message": message, "time": when})


def _newest_checkpoint(output_dir: str) -> str:
    from sft.run import checkpoint as ckpt

    complete = [c for c in ckpt.checkpoints(output_dir) if ckpt.is_complete(c)]
    if not complete:
        return "No checkpoint was complete before it."
    return f"The newest complete checkpoint, {Path(complete[-1]).name}, is from before it and intact."


OOM_TEST_ENV = "SFT_TEST_OOM_ABOVE_MICRO_BATCH"  # tests: a CUDA out-of-memory error for micro batches above N, step>=2
LEVERS = levers.advice()  # the memory levers in a line (`sft.plan.levers`)


@dataclass
class Batch:
    """The batch geometry the run trains with, for the out-of-memory message and note."""

    micro: int
    accumulation: int
    global_batch: int
    chosen_by_sft: bool  # per_device_train_batch_size: auto
    plan: str  # the memory plan's figures for this setting, or why there are none
    args: object  # the training arguments (where to record a stop)
    step: int = 0  # the optimizer step being trained


class OutOfMemoryWatch:
    """What an out-of-memory error's message and note need: the batch the run trains with (told once the run is
    planned) and the optimizer step it is at (told each micro batch by the trainer). `sft.train.cli` makes one per
    run and reads it when the error comes."""

    def __init__(self) -> None:
        self.batch: Batch | None = None  # None until planned: an error then is one of loading the model, say

    def planned(self, plan) -> None:
        """The RunPlan `sft.plan.preflight` returned."""
        batch, memory = plan.batch, plan.memory
        self.batch = Batch(batch.per_device_batch_size, batch.gradient_accumulation_steps, batch.global_batch_size,
                           memory.chosen_by_sft, memory.sentence, plan.training_args)  # fmt: skip

    def at_step(self, step: int, micro: int) -> None:
        """Each micro batch: the step being trained; under tests (`OOM_TEST_ENV`), the error CUDA raises, for micro
        batches above the limit from step 2 on."""
        if self.batch is not None:
            self.batch.step = step + 1
        limit = os.environ.get(OOM_TEST_ENV)
        if limit and micro > int(limit) and step >= 2:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB ({OOM_TEST_ENV}={limit}: micro batch {micro})"
            )

    def out_of_memory(self, error: BaseException, error_dir: str | None, rank: int) -> tuple[int, str]:
        """(exit code, message) for an out-of-memory error. With sft's micro batch above 1 under `sft train`
        (`error_dir`), a note for the retry is written there and the code is `OOM_EXIT_CODE`."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        batch = self.batch
        if batch is None:
            return 1, f"out of memory before training started ({first}). Levers: {LEVERS}."
        where = f"micro batch {batch.micro} x accumulation {batch.accumulation} (global batch {batch.global_batch})"
        code, message = _out_of_memory(batch, where, first, error_dir, rank)
        if code != OOM_EXIT_CODE:
            stop(batch.args, batch.step, "out of memory", message)
        return code, message


def retried(args, step: int) -> None:
    """A run that `sft train` started again after an out-of-memory error: an event line at the step it starts from,
    and the retry in sft_run.json (main process)."""
    retry = Retry.from_env()
    if retry is None or args.process_index != 0:
        return
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    event = {"micro_batch": micro, "accumulation": accumulation, "global_batch": retry.global_batch}
    record(args, {"step": step, "out_of_memory_retry": event})
    from sft.run import checkpoint as ckpt

    retries = (ckpt.read_manifest(Path(args.output_dir)) or {}).get("out_of_memory_retries", [])
    ckpt.update_manifest(args.output_dir, out_of_memory_retries=[*retries, {"step": step, **event}])


def _out_of_memory(batch: Batch, where: str, first: str, error_dir: str | None, rank: int) -> tuple[int, str]:
    if not batch.chosen_by_sft:
        return 2, (
            f"out of memory at {where}, per_device_train_batch_size set by hand ({first}). {batch.plan} Set "
            f"per_device_train_batch_size: auto to let sft choose (sft train then retries smaller by itself), a "
            f"smaller micro batch with the same global_batch_size, or: {LEVERS}."
        )
    if batch.micro == 1:
        return 2, (
            f"out of memory at {where}, the smallest micro batch ({first}). {batch.plan} What is left: {LEVERS}."
        )
    half = batch.micro // 2
    if error_dir is not None:
        note = {"micro": batch.micro, "retry_micro": half, "global_batch": batch.global_batch}
        (Path(error_dir) / f"oom-rank{rank}.json").write_text(json.dumps(note))
        return OOM_EXIT_CODE, f"out of memory at {where} ({first}); sft train retries with micro batch {half}."
    return 2, (
        f"out of memory at {where}, sft's choice ({first}). {batch.plan} `sft train` retries with half the micro "
        f"batch by itself; under this launcher run the same command again with --per_device_train_batch_size {half} "
        f"--global_batch_size {batch.global_batch} (it resumes from the newest complete checkpoint), or: {LEVERS}."
    )

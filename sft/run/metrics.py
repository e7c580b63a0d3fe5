"""What a run measures and writes about itself: the metrics log, throughput/MFU/memory, the data trace, the wandb link.

- `MetricsLog`: every log event of the main process appended to `<output_dir>/metrics.jsonl` (a transformers
  callback), trimmed to the resume point on a resume.
- `Throughput`: the clock and FLOP counter behind `tokens_per_step`, `tokens_per_second_per_gpu`, `tflops_per_gpu`,
  `mfu`, `num_flops`, `peak_memory_gib`, `peak_reserved_gib`, `alloc_retries` (the caching allocator's
  `num_alloc_retries` so far: each freed its cache and waited) in every training log; time in evaluation and
  checkpoint saves is left out (`paused`). Per-GPU figures divide by the number of processes (`sft.core.dims`),
  each of which is one GPU.
- `DataTrace`: with `trace_data`, one line per micro-batch and rank (step, tokens, SHA-1, per-sample digests);
  `samples_per_step` reads it back.
- `record_wandb_run`: `<output_dir>/wandb_run.json`, so that `eval/run.py` can log to the training run.

`sft.run.trainer.Trainer` wires these into TRL's SFTTrainer; none of them knows about the others.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from sft.core.outputs import DISCARDED_METRICS_FILE, METRICS_FILE
from sft.model.flops import FlopCounter, detect_peak_tflops, sample_lengths

logger = logging.getLogger(__name__)

DATA_TRACE_DIR = "data_trace"
WANDB_RUN_FILE = "wandb_run.json"


def append(output_dir: str | Path, record: dict) -> None:
    """One JSON line appended to `<output_dir>/metrics.jsonl`: the one writer of the file (training logs, the resume
    marker, the fail-safe's events). Callers write from the main process only."""
    path = Path(output_dir) / METRICS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class MetricsLog(TrainerCallback):
    """Append every log event of the main process to `<output_dir>/metrics.jsonl`, one JSON object a line.

    Each line has `step`, `epoch`, a wall-clock `time` and everything the trainer logged at that step (loss,
    learning_rate, grad_norm, num_tokens, mean_token_accuracy, eval metrics, ...). On resume from step k, lines of
    steps after k (written by the attempt that crashed, and about to be trained again) move to
    `metrics.discarded.jsonl`, so the file reads as one run, and a line `{"step": k, "resumed_from_step": k}` marks
    the resume.
    """

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.path = Path(output_dir) / METRICS_FILE

    def keep_until(self, step: int) -> None:
        if not self.path.is_file():
            return
        lines = self.path.read_text().splitlines(keepends=True)
        keep = [line for line in lines if json.loads(line)["step"] <= step]
        if len(keep) == len(lines):
            return
        with open(self.path.with_name(DISCARDED_METRICS_FILE), "a") as f:
            f.writelines(line for line in lines if json.loads(line)["step"] > step)
        self.path.write_text("".join(keep))
        logger.warning("metrics.jsonl: moved %d lines after step %d to %s", len(lines) - len(keep), step, f.name)

    def mark_resume(self, step: int) -> None:
        """One line saying training resumed from `step` (`sft.run.report` marks it on every plot)."""
        append(self.output_dir, {"step": step, "time": time.time(), "resumed_from_step": step})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        append(self.output_dir, {"step": state.global_step, "epoch": state.epoch, "time": time.time(), **logs})


class Throughput(TrainerCallback):
    """Tokens, FLOPs and memory since the previous training log; the clock starts when the first step starts (after
    DeepSpeed and the data loader are set up) and pauses in evaluation and checkpoint saves."""

    def __init__(self, model: torch.nn.Module, peak_tflops: float | None, processes: int, arch=None):
        self.flops = FlopCounter(model, arch)
        self.processes = processes
        self.total_flops = 0.0
        self.peak_tflops = self._peak(peak_tflops)
        self._last = (0, 0, time.perf_counter())  # (global step, tokens, time) at the last training log
        self._paused_s = 0.0
        self.setup_peak_gib = 0.0

    def _peak(self, given: float | None) -> float | None:
        peak, where = given, "given by `peak_tflops`"
        if peak is None and torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            peak, where = detect_peak_tflops(name), f"dense bf16 peak of the {name}"
            if peak is None:
                logger.warning("MFU is not logged: no peak on file for the %s; set `peak_tflops` to log it", name)
        if peak is not None:
            logger.info(
                "MFU against %.0f TFLOP/s per GPU (%s); training FLOPs: %.4g per token in linear layers + "
                "6 x %d layers x %d x sum(sample length^2) in causal attention",
                peak,
                where,
                self.flops.per_token,
                self.flops.layers,
                self.flops.width,
            )
        return peak

    def start(self, step: int, tokens: int) -> None:
        self._last = (step, tokens, time.perf_counter())
        self._paused_s = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        step, tokens, _ = self._last
        self.start(step, tokens)
        if torch.cuda.is_available():  # the model build and the engine's set-up are done: their peak is apart
            self.setup_peak_gib = torch.cuda.max_memory_allocated() / 2**30
            logger.info(
                "GPU memory before the first step: peak %.2f GiB while building the model and the engine, "
                "%.2f GiB held now; `peak_memory_gib` in the logs counts from here",
                self.setup_peak_gib,
                torch.cuda.memory_allocated() / 2**30,
            )
            torch.cuda.empty_cache()  # what loading left reserved (it counts against `max_gpu_memory_gib`)
            torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is left out of the next training log's tokens/s and MFU."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - start

    def add(self, inputs: dict, info=None, sp: int = 1) -> None:
        """Count a micro-batch. Under sequence parallelism (`info`: the row before it was split) every sp rank
        counts 1/sp of the whole row's real samples, so the sum over ranks counts each real token once."""
        if info is None:
            self.flops.add(inputs)
        else:
            self.flops.add(inputs, torch.tensor(info.lengths), share=1 / sp)

    def log(self, logs: dict, step: int, tokens: int, device: torch.device) -> None:
        """Add the figures since the last training log to `logs`; a collective (every rank calls it)."""
        flops = self.flops.take(device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flops)
        flops = float(flops)
        self.total_flops += flops
        last_step, last_tokens, last_time = self._last
        now, steps = time.perf_counter(), step - last_step
        seconds = now - last_time - self._paused_s
        if steps > 0 and seconds > 0:
            logs["tokens_per_step"] = (tokens - last_tokens) / steps
            logs["tokens_per_second_per_gpu"] = (tokens - last_tokens) / seconds / self.processes
            logs["tflops_per_gpu"] = flops / seconds / self.processes / 1e12
            if self.peak_tflops:
                logs["mfu"] = logs["tflops_per_gpu"] / self.peak_tflops
                logs["peak_tflops"] = self.peak_tflops
        logs["num_flops"] = self.total_flops
        if torch.cuda.is_available():
            logs["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            logs["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30  # what the allocator held
            logs["setup_peak_memory_gib"] = self.setup_peak_gib
            # times the caching allocator freed its cache and tried again (near the memory limit: slow steps)
            logs["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        self.start(step, tokens)


class DataTrace:
    """`<output_dir>/data_trace/rank<R>.jsonl`: one line per micro-batch of this rank."""

    def __init__(self, output_dir: str, rank: int, processes: int):
        self.dir = Path(output_dir) / DATA_TRACE_DIR
        self.rank, self.processes = rank, processes

    @property
    def path(self) -> Path:
        return self.dir / f"rank{self.rank}.jsonl"

    def keep_until(self, step: int) -> None:
        """Drop lines of steps at or after the resume point: they are about to be trained again.

        Each rank trims its own file; the main process also trims the files of ranks that this run no longer has
        (a resume on fewer processes).
        """
        paths = [self.path]
        if self.rank == 0:
            paths += [p for p in self.dir.glob("rank*.jsonl") if int(p.stem.removeprefix("rank")) >= self.processes]
        for path in paths:
            if path.is_file():
                lines = path.read_text().splitlines(keepends=True)
                path.write_text("".join(line for line in lines if json.loads(line)["step"] < step))

    def record(self, step: int, inputs: dict, info=None) -> None:
        """One line: step, real tokens, SHA-1 of the micro-batch, and a short digest of every sample in it.

        The per-sample digests let runs on different process counts be compared step by step: the rows of one
        optimizer step are split over other ranks and micro-batches, but the multiset of samples is the same.
        """
        input_ids = inputs["input_ids"].detach().cpu()
        mask = inputs.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else input_ids.numel()
        digest = hashlib.sha1(input_ids.numpy().tobytes()).hexdigest()
        if info is not None:  # a slice of a sequence-parallel row: the row's samples, digested before the split
            tokens, samples = info.tokens, list(info.samples)
        else:
            lengths = sample_lengths(inputs).cpu().tolist()
            flat = input_ids[mask.bool().cpu()] if mask is not None else input_ids.flatten()
            samples = [hashlib.sha1(s.numpy().tobytes()).hexdigest()[:16] for s in flat.split(lengths)]
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "tokens": tokens, "sha1": digest, "samples": samples}) + "\n")


def samples_per_step(output_dir: str | Path) -> dict[int, list[str]]:
    """From a run's data trace: the digests of every sample trained at each optimizer step, over all ranks, sorted.
    Equal for two runs that trained the same samples at every step, on any number of processes."""
    steps: dict[int, list[str]] = {}
    for path in (Path(output_dir) / DATA_TRACE_DIR).glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            steps.setdefault(record["step"], []).extend(record["samples"])
    return {step: sorted(samples) for step, samples in sorted(steps.items())}


def record_wandb_run(args) -> bool:
    """Write <output_dir>/wandb_run.json (main process, wandb on, a run started); True once written."""
    if not args.should_save or "wandb" not in args.report_to:
        return False
    import wandb

    if wandb.run is None:
        return False
    run = {"id": wandb.run.id, "project": wandb.run.project, "entity": wandb.run.entity, "name": wandb.run.name}
    path = Path(args.output_dir) / WANDB_RUN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run) + "\n")
    return True

"""sft's trainer: TRL's SFTTrainer plus complete-marked checkpoints, pre-emption, a metrics log and a data trace."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import time
from pathlib import Path

import torch
from transformers import TrainerCallback
from trl import SFTTrainer

from sft import checkpoint as ckpt
from sft.attention import check_batch
from sft.engines import deepspeed as ds_engine
from sft.errors import ConfigError
from sft.flops import FlopCounter, detect_peak_tflops, sample_lengths

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
DISCARDED_METRICS_FILE = "metrics.discarded.jsonl"
DATA_TRACE_DIR = "data_trace"
WANDB_RUN_FILE = "wandb_run.json"
# Test hook: the main process SIGKILLs itself in the save of this step, after every file but the marker is written.
KILL_DURING_SAVE_ENV = "SFT_TEST_KILL_DURING_SAVE"


class MetricsJsonlCallback(TrainerCallback):
    """Append every log event of the main process to `<output_dir>/metrics.jsonl`, one JSON object a line.

    Each line has `step`, `epoch`, a wall-clock `time` and everything the trainer logged at that step (loss,
    learning_rate, grad_norm, num_tokens, mean_token_accuracy, eval metrics, ...). On resume from step k, lines of
    steps after k (written by the attempt that crashed, and about to be trained again) move to
    `metrics.discarded.jsonl`, so the file reads as one run.
    """

    def __init__(self, output_dir: str):
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

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, "epoch": state.epoch, "time": time.time(), **logs}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class PreemptionCallback(TrainerCallback):
    """SIGTERM/SIGUSR1 on any rank: all ranks agree (one all-reduce per step), save a checkpoint and stop."""

    def __init__(self):
        self.requested = False
        self.preempted = False

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        logger.warning(
            "Received %s: will save a checkpoint and stop after this optimizer step", signal.Signals(signum).name
        )

    def on_step_end(self, args, state, control, **kwargs):
        flag = torch.tensor(float(self.requested), device=args.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() > 0:
            self.preempted = True
            control.should_save = True
            control.should_training_stop = True
        return control


class ThroughputClockCallback(TrainerCallback):
    """Start the throughput clock when the first step starts, after DeepSpeed and the data loader are set up."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        step, tokens, _ = self.trainer._last_logged
        self.trainer._last_logged = (step, tokens, time.perf_counter())
        self.trainer._paused_s = 0.0


class Trainer(SFTTrainer):
    """TRL's `SFTTrainer` with sft's additions; packing, collation and loss are TRL's.

    `fingerprint` (from `sft.checkpoint.fingerprint`) is stored in every checkpoint so that a resume can be checked.

    Every training log adds, over the steps since the previous one (time spent in evaluation and checkpointing left
    out): `tokens_per_step` and `tokens_per_second_per_gpu` (real tokens, all ranks), `tflops_per_gpu` and `mfu`
    (`sft.flops`: linear layers + causal attention over the real sample lengths, against `peak_tflops`),
    `num_flops` (cumulative, like TRL's `num_tokens`; both survive a resume) and `peak_memory_gib`.
    """

    def __init__(self, *args, fingerprint: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fingerprint = fingerprint or {}
        self.metrics_log = MetricsJsonlCallback(self.args.output_dir)
        self.preemption = PreemptionCallback()
        self.add_callback(self.metrics_log)
        self.add_callback(self.preemption)
        self.resumed_from: str | None = None
        self._last_logged = (0, 0, time.perf_counter())  # (global step, tokens, time) at the last training log
        self._paused_s = 0.0  # seconds in evaluation and checkpoint saves since the last training log
        self.add_callback(ThroughputClockCallback(self))
        self.flop_counter = FlopCounter(self.model)
        self._total_train_flops = 0.0
        self.peak_tflops = self._peak_tflops()

    def _peak_tflops(self) -> float | None:
        peak = getattr(self.args, "peak_tflops", None)
        where = "given by `peak_tflops`"
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
                self.flop_counter.per_token,
                self.flop_counter.layers,
                self.flop_counter.width,
            )
        return peak

    @property
    def preempted(self) -> bool:
        return self.preemption.preempted

    def train(self, resume_from_checkpoint: str | None = None, **kwargs):
        step = 0
        if resume_from_checkpoint:
            saved = ckpt.read_state(resume_from_checkpoint)
            step = saved["global_step"]
            self._refuse_finished(step, resume_from_checkpoint)
            self._total_train_tokens = saved["total_train_tokens"]
            self._total_train_flops = saved.get("total_train_flops", 0.0)
            for mode, values in saved["metrics"].items():
                self._metrics[mode].update({k: list(v) for k, v in values.items()})
            logger.info(
                "Resuming from %s: step %d, %d samples and %d tokens seen",
                resume_from_checkpoint,
                step,
                saved["samples_seen"],
                saved["total_train_tokens"],
            )
        self.resumed_from = resume_from_checkpoint
        self._last_logged = (step, self._total_train_tokens, time.perf_counter())
        if self.args.process_index == 0:
            self.metrics_log.keep_until(step)
        self._trace_keep_until(step)
        self.preemption.install()
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """transformers loads the checkpoint here; a universal (other process count) load needs its state placed."""
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        optimizer = ds_engine.base_optimizer(self.model_wrapped) if resume_from_checkpoint else None
        if optimizer is not None:
            moved = ds_engine.place_optimizer_state(optimizer)
            if moved:
                logger.info("Placed %d optimizer-state tensors as %s expects them", moved, type(optimizer).__name__)
        return model, train_dataloader

    def _refuse_finished(self, step: int, checkpoint: str) -> None:
        """transformers "finishes" at once when the checkpoint is already at the last step; say so instead."""
        if self.args.max_steps > 0:
            total, what = self.args.max_steps, f"max_steps {self.args.max_steps}"
        else:
            per_epoch = max(len(self.get_train_dataloader()) // self.args.gradient_accumulation_steps, 1)
            total = math.ceil(per_epoch * self.args.num_train_epochs)
            what = f"num_train_epochs {self.args.num_train_epochs} ({total} steps)"
        if step >= total:
            raise ConfigError(
                f"{checkpoint} is at step {step} and the run asks for {what}: nothing is left to train. Raise "
                "max_steps/num_train_epochs to train further, or use a new --output_dir for a new run."
            )

    @contextlib.contextmanager
    def _clock_paused(self):
        """Time spent inside is left out of the next training log's tokens/s and MFU."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused_s += time.perf_counter() - start

    def evaluate(self, *args, **kwargs):
        with self._clock_paused():
            return super().evaluate(*args, **kwargs)

    def _save_checkpoint(self, model, trial):
        with self._clock_paused():
            self._save_complete_checkpoint(model, trial)

    def _save_complete_checkpoint(self, model, trial):
        limit = self.args.save_total_limit
        self.args.save_total_limit = None  # rotate only after the new checkpoint is marked complete
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        step = self.state.global_step
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{step}"
        if self.args.should_save:
            global_batch = self.fingerprint.get("global_batch", 0)
            ckpt.write_json_synced(
                folder / ckpt.STATE,
                {
                    "global_step": step,
                    "samples_seen": step * global_batch,
                    "total_train_tokens": int(self._total_train_tokens),
                    "total_train_flops": self._total_train_flops,
                    "metrics": {mode: dict(values) for mode, values in self._metrics.items()},
                    "fingerprint": self.fingerprint,
                },
            )
        os.sync()  # every rank's files on disk ...
        self.accelerator.wait_for_everyone()  # ... on every rank, before the marker
        if os.environ.get(KILL_DURING_SAVE_ENV) == str(step) and self.args.process_index == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.args.should_save:
            ckpt.write_json_synced(folder / ckpt.MARKER, {"step": step, "world_size": self.args.world_size})
            keep = {str(Path(p).resolve()) for p in (self.resumed_from, self.state.best_model_checkpoint) if p}
            ckpt.rotate(self.args.output_dir, limit, keep)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.padding_free:
            check_batch(inputs)
            if self.args.max_length:  # real tokens / (rows x max_length) of this micro-batch, on this rank
                rows = self.args.per_device_train_batch_size
                self._metrics["train"]["packing_efficiency"].append(
                    inputs["input_ids"].numel() / (rows * self.args.max_length)
                )
        if getattr(self.args, "trace_data", False):
            self._trace_batch(inputs)
        self.flop_counter.add(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: every rank is here (the loss was just all-gathered)
            self._log_throughput(logs)
        super().log(logs, start_time)
        self._record_wandb_run()

    def _log_throughput(self, logs: dict[str, float]) -> None:
        """Tokens, FLOPs and memory of all ranks since the last training log; a collective (every rank calls it)."""
        flops = self.flop_counter.take(self.args.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(flops)
        flops = float(flops)
        self._total_train_flops += flops
        last_step, last_tokens, last_time = self._last_logged
        now, steps, tokens = time.perf_counter(), self.state.global_step - last_step, self._total_train_tokens
        seconds, world = now - last_time - self._paused_s, self.args.world_size
        if steps > 0 and seconds > 0:
            logs["tokens_per_step"] = (tokens - last_tokens) / steps
            logs["tokens_per_second_per_gpu"] = (tokens - last_tokens) / seconds / world
            logs["tflops_per_gpu"] = flops / seconds / world / 1e12
            if self.peak_tflops:
                logs["mfu"] = logs["tflops_per_gpu"] / self.peak_tflops
                logs["peak_tflops"] = self.peak_tflops
        logs["num_flops"] = self._total_train_flops
        if torch.cuda.is_available():
            logs["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        self._last_logged = (self.state.global_step, tokens, now)
        self._paused_s = 0.0

    def _record_wandb_run(self) -> None:
        """Write <output_dir>/wandb_run.json once, so that eval/run.py can log to this training run."""
        if getattr(self, "_wandb_recorded", False) or not self.args.should_save or "wandb" not in self.args.report_to:
            return
        import wandb

        if wandb.run is None:
            return
        run = {"id": wandb.run.id, "project": wandb.run.project, "entity": wandb.run.entity, "name": wandb.run.name}
        path = Path(self.args.output_dir) / WANDB_RUN_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run) + "\n")
        self._wandb_recorded = True

    def _trace_path(self) -> Path:
        return Path(self.args.output_dir) / DATA_TRACE_DIR / f"rank{self.args.process_index}.jsonl"

    def _trace_keep_until(self, step: int) -> None:
        """Drop trace lines of steps at or after the resume point: they are about to be trained again.

        Each rank trims its own file; the main process also trims the files of ranks that this run no longer has
        (a resume on fewer processes).
        """
        paths = [self._trace_path()]
        if self.args.process_index == 0:
            paths += [
                p
                for p in self._trace_path().parent.glob("rank*.jsonl")
                if int(p.stem.removeprefix("rank")) >= self.args.world_size
            ]
        for path in paths:
            if path.is_file():
                lines = path.read_text().splitlines(keepends=True)
                path.write_text("".join(line for line in lines if json.loads(line)["step"] < step))

    def _trace_batch(self, inputs) -> None:
        """One line: step, real tokens, SHA-1 of the micro-batch, and a short digest of every sample in it.

        The per-sample digests let runs on different process counts be compared step by step: the rows of one
        optimizer step are split over other ranks and micro-batches, but the multiset of samples is the same.
        """
        input_ids = inputs["input_ids"].detach().cpu()
        mask = inputs.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else input_ids.numel()
        digest = hashlib.sha1(input_ids.numpy().tobytes()).hexdigest()
        lengths = sample_lengths(inputs).cpu().tolist()
        flat = input_ids[mask.bool()] if mask is not None else input_ids.flatten()
        samples = [hashlib.sha1(s.numpy().tobytes()).hexdigest()[:16] for s in flat.split(lengths)]
        record = {"step": self.state.global_step, "tokens": tokens, "sha1": digest, "samples": samples}
        path = self._trace_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

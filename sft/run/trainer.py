"""sft's trainer: TRL's SFTTrainer wired to sft's components; packing, collation and loss are TRL's.

- checkpoints (`sft.run.checkpoint`): complete-marked saves with sft_state.json, rotation after the marker,
  pre-emption;
- metrics (`sft.run.metrics`): metrics.jsonl, throughput/MFU/memory in every training log, the data trace, the wandb
  link;
- the engine (`sft.engines`, the run plan's): the checkpoint load, the optimizer state placed after it;
- packing (`sft.model.attention`): every padding-free micro-batch checked to keep its samples apart;
- sequence parallelism (`sft.parallel.sequence`): accelerate's Ulysses config, sliceable batches, the loss without
  SP's weighting, tokens and FLOPs of the real samples counted once per replica;
- the tiled MLP (`sft.model.tiling`) and checkpointing that keeps attention outputs (`sft.model.checkpointing`) when
  the plan or the recipe asks for them (offloaded checkpoints are transformers');
- the one-GPU optimizer (`sft.run.optimizer`): torchao's 8-bit AdamW stepped by one fused kernel per tensor;
- a step whose loss or gradient norm is not finite is not applied, and stops the run (`sft.run.failsafe`).
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import torch
from trl import SFTTrainer

from sft.core.batch import steps_per_epoch
from sft.core.run import RunPlan
from sft.errors import ConfigError
from sft.model import converters, fp8, quantization
from sft.model.attention import check_batch
from sft.parallel import sequence as seqpar
from sft.run import checkpoint as ckpt
from sft.run import failsafe, metrics, packing_check
from sft.run.optimizer import fused_class

logger = logging.getLogger(__name__)


# CPython releases whose forked child can deadlock in PyOS_AfterFork_Child on a lock another thread held at the fork
# (python/cpython#112275; fixed in 3.10.15 and 3.11.10, never present in 3.12+)
_FORK_DEADLOCK = (3, 10) <= sys.version_info < (3, 10, 15) or (3, 11) <= sys.version_info < (3, 11, 10)


def fork_warning(args) -> str | None:
    """A warning for DataLoader workers forked by a Python whose forked child can deadlock; None elsewhere."""
    if not _FORK_DEADLOCK or args.dataloader_num_workers == 0:
        return None
    if args.dataloader_multiprocessing_context not in (None, "fork"):
        return None
    version = ".".join(map(str, sys.version_info[:3]))
    return (
        f"dataloader_num_workers {args.dataloader_num_workers} forks workers from a multi-threaded process, and on "
        f"Python {version} a forked child can hang for ever (python/cpython#112275, fixed in 3.10.15 and 3.11.10; "
        "seen in sft's CI). Upgrade Python, or set dataloader_multiprocessing_context: spawn (each worker then "
        "imports torch itself: seconds per worker at every epoch)."
    )


class Trainer(SFTTrainer):
    """TRL's `SFTTrainer` with sft's additions.

    `fingerprint` (from `sft.run.checkpoint.fingerprint`) is stored in every checkpoint so that a resume can be
    checked. Every training log adds `tokens_per_step`, `tokens_per_second_per_gpu`, `tflops_per_gpu`, `mfu`,
    `num_flops` and `peak_memory_gib` (`sft.run.metrics.Throughput`); `packing_efficiency` is real tokens / (rows x
    max_length) of each micro-batch.
    """

    def __init__(self, *args, plan: RunPlan, fingerprint: dict | None = None, watch=None, **kwargs):
        self.plan = plan
        self.watch = watch if watch is not None else failsafe.OutOfMemoryWatch()  # the step an OOM names
        dims = plan.dims
        self.sequence_steps = seqpar.TrainerSteps.of(plan)  # sequence parallelism's steps, or None
        if self.sequence_steps:
            self.sequence_steps.configure(kwargs["args"])
        super().__init__(*args, **kwargs)
        self.fingerprint = fingerprint or {}
        self._shard_info: seqpar.ShardInfo | None = None
        if self.sequence_steps:
            self.sequence_steps.attach(self)
        warning = fork_warning(self.args)
        if warning:
            logger.warning(warning)
        self.metrics_log = metrics.MetricsLog(self.args.output_dir)
        self.throughput = metrics.Throughput(self.model, self.args.peak_tflops, dims.world_size, plan.arch)
        self.trace = metrics.DataTrace(self.args.output_dir, self.args.process_index, dims.world_size)
        self.preemption = ckpt.PreemptionCallback()
        for callback in (self.metrics_log, self.throughput, self.preemption, *fp8.step_callbacks(self.model)):
            self.add_callback(callback)
        if plan.packing_check.on:  # the first rows against their samples alone, before the first step
            self.add_callback(packing_check.Callback(self, plan.packing_check.reason))
        self.resumed_from: str | None = None
        self._wandb_recorded = False
        self.guard = failsafe.StepGuard(self.args)
        self.zero_loss = failsafe.ZeroLoss()
        self._hf_shapes = None  # expert parallelism: the layout the model is saved in (AutoEP replaces its layers)
        self.experts = plan.engine.experts  # the engine's expert-parallel component, or None
        if self.experts is not None:
            self.experts.compatible_output_registry()
            self._hf_shapes = self.experts.hf_shapes(self.model)

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.plan.engine.accelerator_ready(self)

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
            self.throughput.total_flops = saved.get("total_train_flops", 0.0)
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
        self.throughput.start(step, self._total_train_tokens)
        if self.args.process_index == 0:
            self.metrics_log.keep_until(step)
            if resume_from_checkpoint:
                self.metrics_log.mark_resume(step)
        failsafe.retried(self.args, step)  # after an out-of-memory error, `sft train` runs this again
        self.trace.keep_until(step)
        self.preemption.install()
        starting = self.plan.engine.starting()
        if starting:
            logger.info("%s", starting)
        return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        """transformers loads the checkpoint here. After any DeepSpeed load the optimizer state is placed as torch's
        `load_state_dict` would; only a universal load (another process count) bypasses that, so elsewhere nothing
        moves. The tiled MLP goes on first: Liger has patched the MLPs by now (in `train`), and the tiles wrap it."""
        converters.apply("prepare", self.model, self.plan)
        with self.plan.engine.loading_checkpoint():
            model, train_dataloader = super()._prepare_for_training(
                max_steps, train_dataloader, resume_from_checkpoint
            )
        moved = quantization.place_quant_states(self.model)  # QLoRA loaded in host memory under ZeRO-3
        if moved:
            logger.info("QLoRA: the quantization constants of %d layers moved to this GPU", moved)
        converters.apply("wrapped", self.model, self.plan)
        if self.sequence_steps:
            train_dataloader = self.sequence_steps.loader(self, train_dataloader, resume_from_checkpoint)
        if resume_from_checkpoint:
            self.plan.engine.after_load(self.model_wrapped)
        return model, train_dataloader

    def _refuse_finished(self, step: int, checkpoint: str) -> None:
        """transformers "finishes" at once when the checkpoint is already at the last step; say so instead."""
        if self.args.max_steps > 0:
            total, what = self.args.max_steps, f"max_steps {self.args.max_steps}"
        else:
            batches = len(self.get_train_dataloader()) * self.args.parallel.sp  # each sp rank's batch is a micro-step
            per_epoch = steps_per_epoch(batches, self.args.gradient_accumulation_steps)
            total = math.ceil(per_epoch * self.args.num_train_epochs)
            what = f"num_train_epochs {self.args.num_train_epochs} ({total} steps)"
        if step >= total:
            raise ConfigError(
                f"{checkpoint} is at step {step} and the run asks for {what}: nothing is left to train. Raise "
                "max_steps/num_train_epochs to train further, or use a new --output_dir for a new run."
            )

    def evaluate(self, *args, **kwargs):
        with self.throughput.paused():
            return super().evaluate(*args, **kwargs)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        """transformers' optimizer for `optim`, torchao's 8-bit AdamW stepped by sft's fused kernel where it runs
        (`sft.run.optimizer`)."""
        cls, kwargs = SFTTrainer.get_optimizer_cls_and_kwargs(args, model)
        return fused_class(cls), kwargs

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.plan.engine.optimizer_created(optimizer)
        if self._hf_shapes is not None:  # AutoEP's experts in DeepSpeed's MoE groups (`sft.engines.deepspeed.autoep`)
            self.experts.group_experts(optimizer, self.model, self.args.parallel.ep)
        return optimizer

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Under expert parallelism the model (and each checkpoint's copy) is saved in Hugging Face's layout, its
        experts gathered from the expert ranks (`sft.engines.deepspeed.autoep.hf_state_dict`, collective); the final
        model gathered by the engine where transformers would not write it (`Engine.model_state_to_save`)."""
        if self._hf_shapes is not None and self.experts.layers(self.model):
            return self._save(output_dir, state_dict=self.experts.hf_state_dict(self.model, self._hf_shapes))
        state = None if _internal_call else self.plan.engine.model_state_to_save(self)
        if state is None:
            return super().save_model(output_dir, _internal_call)
        self._save(output_dir, state_dict=state)

    def _save_checkpoint(self, model, trial):
        step = self.state.global_step
        state = {
            "global_step": step,
            "samples_seen": step * self.fingerprint.get("global_batch", 0),
            "total_train_tokens": int(self._total_train_tokens),
            "total_train_flops": self.throughput.total_flops,
            "metrics": {mode: dict(values) for mode, values in self._metrics.items()},
            "fingerprint": self.fingerprint,
        }
        folder = Path(self._get_output_dir(trial=trial)) / f"checkpoint-{step}"
        keep = {str(Path(p).resolve()) for p in (self.resumed_from, self.state.best_model_checkpoint) if p}
        with self.throughput.paused():
            ckpt.save_complete(self, lambda: super(Trainer, self)._save_checkpoint(model, trial), folder, state, keep)

    def training_step(self, model, inputs, num_items_in_batch=None):
        info = self._shard_info = (
            self.sequence_steps.before_step(inputs, self.args.device) if self.sequence_steps else None
        )
        if self.padding_free:
            check_batch(inputs)
            if self.args.max_length:  # real tokens / (rows x max_length) of this micro-batch, on this rank
                rows = self.args.per_device_train_batch_size
                tokens = info.tokens if info else inputs["input_ids"].numel()
                self._metrics["train"]["packing_efficiency"].append(tokens / (rows * self.args.max_length))
        dims = self.args.parallel
        if getattr(self.args, "trace_data", False) and (info is None or dims.sp_rank == 0):
            self.trace.record(self.state.global_step, inputs, info)
        self.throughput.add(inputs, info, dims.sp)
        self.watch.at_step(self.state.global_step, self.args.per_device_train_batch_size)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.guard.add(loss)
        return self.sequence_steps.scaled(loss) if info is not None else loss

    def _get_grad_norm(self, model, grad_norm=None):
        """After the backward of each optimizer step, before `optimizer.step()`: a step that is not finite is not
        applied (`sft.run.failsafe`): its gradients are dropped here (DeepSpeed has skipped it already)."""
        grad_norm = super()._get_grad_norm(model, grad_norm)
        reduce = lambda t: self.accelerator.reduce(t, "sum")  # noqa: E731
        if (
            self.guard.check(self.state.global_step + 1, grad_norm, reduce)
            and not self.plan.engine.drops_nonfinite_steps
        ):
            model.zero_grad(set_to_none=True)  # torch's optimizers step no parameter without a gradient
        return grad_norm

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        info = self._shard_info
        if info is None or not model.training or return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return self.sequence_steps.loss(
            self, model, inputs, num_items_in_batch, info
        )  # sequence parallel: the loss without SP

    def _get_num_items_in_batch(self, batch_samples, device):
        """Under sequence parallelism the trained tokens of the optimizer step, each counted once (`TrainerSteps`)."""
        if self.sequence_steps:
            return self.sequence_steps.step_tokens(self, batch_samples, device)
        return super()._get_num_items_in_batch(batch_samples, device)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        seqpar.take_info(inputs)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: every rank is here (the loss was just all-gathered)
            self.throughput.log(logs, self.state.global_step, self._total_train_tokens, self.args.device)
            load = getattr(self.model, "sft_router_load", None)
            if load is not None:
                reduce = torch.distributed.all_reduce if torch.distributed.is_initialized() else None
                logs.update(load.summary(reduce))
            self.zero_loss.log(self.state.global_step, logs["loss"])
        super().log(logs, start_time)
        if not self._wandb_recorded:
            self._wandb_recorded = metrics.record_wandb_run(self.args)

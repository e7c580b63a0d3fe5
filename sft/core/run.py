"""What a run is, decided once before any expensive work (`sft.plan.preflight.preflight`) and handed on as one frozen
object: model building, the trainer, the fingerprint, the fail-safe and the report read it; none re-derives these
facts from the training arguments, the environment or the engine's JSON."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from sft.core.dims import ParallelDims

# The batch geometry of a checkpoint's fingerprint (whole numbers in a checkpoint sft resumes: `sft.run.checkpoint`
# checks them; `Resume` reads them; the plan keeps the global batch by recomputing accumulation)
GEOMETRY_FIELDS = ("world_size", "per_device_train_batch_size", "gradient_accumulation_steps", "global_batch")


@dataclass(frozen=True)
class Resume:
    """The checkpoint a run resumes and the geometry it was written with (from its fingerprint)."""

    checkpoint: str
    world_size: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    global_batch: int
    ep: int = 1  # expert-parallel size (fingerprints before it: 1)
    autoep: bool = False  # the MoE layers were AutoEP's (`sft.engines.deepspeed.autoep`)
    optim: str | None = None  # the optimizer it was trained with (fingerprints before it: None)

    @classmethod
    def of(cls, checkpoint: str, fingerprint: dict) -> Resume:
        parallel = fingerprint.get("parallel", {})
        ep = parallel.get("ep", 1)
        geometry = (fingerprint[k] for k in GEOMETRY_FIELDS)  # present: sft.run.checkpoint.damage checked them
        return cls(checkpoint, *geometry, ep, parallel.get("autoep", ep > 1), fingerprint.get("optim"))

    def describe(self) -> str:
        return (
            f"{self.checkpoint} was trained with a global batch of {self.global_batch} ({self.world_size} processes x "
            f"{self.per_device_train_batch_size} x {self.gradient_accumulation_steps} accumulation)"
        )


class Check(NamedTuple):
    """A check the run makes before its first step (`packing_check`), and why it is on or off."""

    on: bool
    reason: str


@dataclass(frozen=True)
class MemoryDecision:
    """The memory plan's choice: the micro batch, the levers (`sft.plan.memory.Tools`), the sequence-parallel size, the
    optimizer's offload share, and the plan's figures in a sentence (for the out-of-memory message)."""

    micro_batch: int
    tools: Any  # sft.plan.memory.Tools
    sp: int
    offload_ratio: float
    sentence: str
    chosen_by_sft: bool  # per_device_train_batch_size: auto


@dataclass(frozen=True)
class RunPlan:
    """One run, decided: its resolved training arguments (what transformers and TRL are given), the model's config
    and Architecture, the parallel sizes, the batch (with the steps of an epoch, `sft.core.batch`), the memory
    decision, the attention backend, each kernel decision with its reason, the engine with its resolved configuration,
    and the checkpoint it resumes."""

    training_args: Any  # sft.config.TrainConfig, resolved
    model_config: Any  # transformers' PretrainedConfig, loaded once
    arch: Any  # sft.model.architectures.Architecture
    batch: Any  # sft.core.batch.BatchPlan
    memory: MemoryDecision
    attn_implementation: str | None
    kernels: dict = field(default_factory=dict)  # name -> sft.model.architectures.Kernel(on, reason)
    resume: Resume | None = None
    lora: bool = False  # PEFT's adapters on the base weights (use_peft)
    vision: Any = None  # sft.data.vision.Plan: image+text chats packed by sft (a vision-language family), or None
    dims: ParallelDims | None = None  # the parallel sizes of the resolved arguments (the plan always sets them)
    engine: Any = None  # the run's engine (`sft.engines.Engine`), built once from the resolved configuration
    packing_check: Check = Check(False, "not decided")  # packed rows against their samples alone, before step 1

    def kernel_on(self, name: str) -> bool:
        kernel = self.kernels.get(name)
        return bool(kernel and kernel.on)

"""Parallel dimensions: how the processes of a run split the work, computed once and read everywhere else.

Every process of a run is one GPU (or one CPU process). sft spreads work two ways: data parallelism with DeepSpeed ZeRO
(`dp` replicas, each reading its own data) and sequence parallelism (`sp` ranks sharing the tokens of one packed row,
`sft.parallel.sequence`); world size = dp x sp. A mixture-of-experts model's experts may also be split over `ep` data-
parallel ranks (`sft.engines.deepspeed.autoep`, DeepSpeed AutoEP): those ranks still read their own data, so `ep`
divides `dp` and changes no batch arithmetic, only where the experts live. Tensor parallelism may follow. Everything
that needs one of these sizes — the batch arithmetic (`sft.core.batch`: global batch = data-parallel size x micro batch
x accumulation), the memory planner, the checkpoint fingerprint and the resume on another process count, tokens/s and
MFU per GPU — reads it from `ParallelDims`, so that a new dimension is a change here plus its consumers' use of it, not
a search for every `world_size` in the package. Like torchtitan's `ParallelDims`, the product of the dimensions must
equal the world size, and a rank's coordinates follow from its global rank (sequence-parallel ranks of one replica are
neighbours); unlike it, no device mesh is built here: DeepSpeed and accelerate build their own process groups from
these sizes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sft.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of one run: `world_size` processes = `dp` (data-parallel replicas) x `sp` (sequence-parallel ranks
    per replica). `gpus_per_node` is the processes of one node (torchrun's LOCAL_WORLD_SIZE); `rank` this process's
    global rank; `ep` the data-parallel ranks each MoE layer's experts are split over (1: every rank has them all)."""

    world_size: int
    dp: int
    sp: int = 1
    gpus_per_node: int | None = None
    rank: int = 0
    ep: int = 1

    def __post_init__(self):
        for name in ("world_size", "dp", "sp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"Parallel size `{name}` must be a whole number >= 1, got {value!r}.")
        if self.dp * self.sp != self.world_size:
            raise ConfigError(
                f"The parallel sizes do not multiply to the number of processes: data-parallel {self.dp} x "
                f"sequence-parallel {self.sp} = {self.dp * self.sp}, but the run has {self.world_size} processes. "
                f"Choose a sequence-parallel size that divides {self.world_size}, or launch dp x sp processes."
            )
        if self.dp % self.ep:
            raise ConfigError(
                f"`expert_parallel_size` {self.ep} does not divide the {self.dp} data-parallel processes of this run. "
                f"Use one of {[d for d in range(1, self.dp + 1) if self.dp % d == 0]}."
            )

    @classmethod
    def build(
        cls, world_size: int, sp: int = 1, gpus_per_node: int | None = None, rank: int = 0, ep: int = 1
    ) -> ParallelDims:
        """The dimensions of `world_size` processes with `sp` sequence-parallel ranks (data parallelism fills the
        rest); a ConfigError names the values when `sp` does not divide the world size."""
        if not isinstance(sp, int) or sp < 1:
            raise ConfigError(f"`sequence_parallel_size` must be a whole number >= 1, got {sp!r}.")
        if world_size % sp:
            raise ConfigError(
                f"`sequence_parallel_size: {sp}` does not divide the {world_size} processes of this run. Use one of "
                f"{[d for d in range(1, world_size + 1) if world_size % d == 0]}, or launch a multiple of {sp} "
                "processes."
            )
        return cls(world_size, world_size // sp, sp, gpus_per_node, rank, ep)

    @classmethod
    def from_env(cls, sp: int = 1, ep: int = 1) -> ParallelDims:
        """The dimensions of this launch (torchrun's / the deepspeed launcher's WORLD_SIZE and LOCAL_WORLD_SIZE)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local, rank = int(os.environ.get("LOCAL_WORLD_SIZE", world)), int(os.environ.get("RANK", "0"))
        return cls.build(world, sp, local, rank, ep)

    @classmethod
    def of(cls, training_args) -> ParallelDims:
        """The dimensions of a run from its training arguments (the processes accelerate found)."""
        world, sp = training_args.world_size, getattr(training_args, "sequence_parallel_size", 1)
        local, ep = int(os.environ.get("LOCAL_WORLD_SIZE", world)), getattr(training_args, "expert_parallel_size", 1)
        return cls.build(world, sp, local, training_args.process_index, ep)

    @property
    def dp_rank(self) -> int:
        """Which data-parallel replica this process belongs to (the data shard it reads)."""
        return self.rank // self.sp

    @property
    def sp_rank(self) -> int:
        """This process's place among the sequence-parallel ranks of its replica."""
        return self.rank % self.sp

    def describe(self) -> str:
        text = f"{self.world_size} process{'es' * (self.world_size > 1)}: data-parallel {self.dp}"
        text += f" x sequence-parallel {self.sp}" if self.sp > 1 else ""
        return text + (f", experts split over {self.ep} of the data-parallel ranks" if self.ep > 1 else "")


def is_routed_expert(name: str) -> bool:
    """Whether parameter `name` is a routed expert's weight: a parameter of an MoE block's `experts` module
    (transformers' fused experts; shared experts are apart). What expert parallelism splits and the plan counts."""
    return name.rsplit(".", 2)[-2:-1] == ["experts"]

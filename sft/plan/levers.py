"""The memory levers for long rows, each one object (`Lever`): its one name (the training argument, the `Setting` field
and the `Tools` field are that name), how a plan's lines call it, whether the speed model ranks it, whose it is (a
training argument, or the engine's offload set in its configuration), the lever it works on and the one it cannot go
with, and what it frees, for the advice of the out-of-memory fail-safe. `Tools` (one setting of every lever),
`MEMORY_LEVELS` (their order from cheapest to dearest), `levels()`, the search's free levers (`run_levers`) and the
fail-safe's advice (`advice`) all read `LEVERS`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Lever:
    """One memory lever. `name`: the training argument (the engine's offload: the `Setting` field), `label`: in a
    plan's lines, `ranked`: measured by the speed sweep (the speed model ranks it with every micro batch; the others
    come on only where nothing ranked fits), `engine`: set in the engine's configuration (ZeRO's offload), not a
    training argument, `needs`: the lever it works on, `excludes`: the lever it cannot go with, `frees`: what it takes
    off the GPU (None: it frees nothing against the lever it works on)."""

    name: str
    label: str
    ranked: bool
    engine: bool = False
    needs: str | None = None
    excludes: str | None = None
    frees: str | None = None


# In the order of `Tools`' fields
LEVERS = (
    Lever("activation_checkpointing", "activation checkpointing", ranked=True, frees="activations"),
    Lever(
        "offload_checkpoints",
        "checkpoints offloaded",
        ranked=False,
        needs="activation_checkpointing",
        excludes="keep_attention_outputs",
        frees="activations",
    ),  # fmt: skip
    Lever("tiled_mlp", "tiled MLP", ranked=False, frees="activations"),
    Lever("offload_optimizer", "optimizer offloaded", ranked=False, engine=True, frees="model states"),
    Lever("offload_params", "weights offloaded", ranked=False, engine=True, frees="model states"),
    # checkpointing that keeps the attention kernels' outputs: faster than checkpointing alone, and larger
    Lever(
        "keep_attention_outputs",
        "attention outputs kept",
        ranked=True,
        needs="activation_checkpointing",
        excludes="offload_checkpoints",
    ),  # fmt: skip
)
BY_NAME = {lever.name: lever for lever in LEVERS}


class Tools(NamedTuple):
    """One setting of every lever (`LEVERS`, in their order): the three activation tools, then ZeRO's CPU offload of
    the optimizer states (ZeRO-2/3; under ZeRO-3 a share of them, `Setting.offload_ratio`) and of the weights
    (ZeRO-3), then checkpointing that keeps the attention kernels' outputs (`sft.model.checkpointing`)."""

    activation_checkpointing: bool
    offload_checkpoints: bool
    tiled_mlp: bool
    offload_optimizer: bool = False
    offload_params: bool = False
    keep_attention_outputs: bool = False

    def on(self) -> list[Lever]:
        return [BY_NAME[name] for name, on in zip(self._fields, self, strict=True) if on]

    def names(self) -> list[str]:
        return [lever.label for lever in self.on()]

    @property
    def valid(self) -> bool:
        """Every lever on has the lever it works on, and none the one it cannot go with (offloaded or
        attention-keeping checkpoints need checkpointing; kept attention outputs stay on the GPU, so not with
        offloaded checkpoints)."""
        return all((not lever.needs or getattr(self, lever.needs)) and not (lever.excludes and getattr(
            self, lever.excludes)) for lever in self.on())  # fmt: skip

    @property
    def ranked(self) -> bool:
        """Levers the speed model ranks: none, or checkpointing (keeping attention outputs or not) on the GPU."""
        return all(lever.ranked for lever in self.on())


def run_levers() -> tuple[str, ...]:
    """The levers that are training arguments (`auto` in a recipe is the search's to set); the others are the
    engine's (`Engine.offload_auto`)."""
    return tuple(lever.name for lever in LEVERS if not lever.engine)


# From cheapest to dearest (`suggest` tries them in this order): activation checkpointing that keeps the attention
# kernels' outputs (one more forward but for the attention kernel), activation checkpointing (one more forward), its
# checkpoints offloaded to pinned CPU memory (a copy out and back per layer), the MLP in
# tiles (DeepSpeed's TiledMLP runs each MLP forward once more; measured in benchmarks/results/long_context, the
# `tools` part), the optimizer states on the CPU (DeepSpeed's CPU Adam steps them there, its gradients copied out:
# a cost per step, not per token, and under ZeRO-3 the smallest share that fits first), then the weights (gathered
# from host memory for every layer in the forward, the recomputation and the backward). The loss is always computed
# in chunks (Liger's fused linear cross-entropy or TRL's fused LM head), so it is no lever.
MEMORY_LEVELS = (
    Tools(False, False, False),
    Tools(True, False, False, keep_attention_outputs=True),
    Tools(True, False, False),
    Tools(True, True, False),
    Tools(True, True, True),
    Tools(True, True, True, True),
    Tools(True, True, True, True, True),
)
# The activation tools alone: what `suggest` tries on each of its candidates (ZeRO stages and offload, `ladder`)
ACTIVATION_LEVELS = MEMORY_LEVELS[:5]


def levels() -> tuple[Tools, ...]:
    """Every combination of levers, `MEMORY_LEVELS` first (in their order), then the others with the fewest levers
    first (offloading the optimizer but keeping the checkpoints on the GPU, say, which leaves host memory to the
    states): what the plan tries for the longest row and for a run's `auto` levers."""
    others = [Tools(*flags) for flags in itertools.product((False, True), repeat=len(Tools._fields))]
    others = [t for t in others if t not in MEMORY_LEVELS and t.valid]
    return MEMORY_LEVELS + tuple(sorted(others, key=sum))


def advice() -> str:
    """The levers in the words of the out-of-memory fail-safe: the training arguments that free activations, then
    the engine's offload of the model states."""
    activations = [f"{lever.name}: true" for lever in LEVERS if lever.frees == "activations" and not lever.engine]
    listed = ", ".join(activations[:-1]) + f" or {activations[-1]}"
    return (f"{listed} for activations; ZeRO-3 (ds_configs/zero3.json) or its CPU offload "
            "(ds_configs/zero3_offload.json) for the model states; a shorter max_length; LoRA; more GPUs")  # fmt: skip

"""DeepSpeed: what sft needs from it, in one place.

`place_optimizer_state`: the mend of a universal-checkpoint load (see there).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def base_optimizer(engine) -> torch.optim.Optimizer | None:
    """The optimizer that steps the fp32 weights: DeepSpeed's ZeRO/bf16 wrappers hold it as `.optimizer`."""
    wrapped = getattr(engine, "optimizer", None)
    inner = getattr(wrapped, "optimizer", wrapped)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def place_optimizer_state(optimizer: torch.optim.Optimizer) -> int:
    """Put every optimizer-state tensor where the optimizer expects it; returns how many were moved.

    DeepSpeed's universal-checkpoint loaders (`BaseOptimizer.load_hp_checkpoint_state_from_checkpoint_dir` for
    ZeRO-1/2, `DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`) assign the state
    read from disk straight into `optimizer.state`, and `ds_to_universal` wrote it from shards loaded with
    `map_location="cpu"`: the `step` counters stay on the CPU. torch's own `Optimizer.load_state_dict`, which a normal
    ZeRO load goes through, would have applied torch's placement rule
    (`Optimizer._process_value_according_to_param_policy`), and without it the first step of a fused or capturable
    AdamW fails ("state_steps is on cpu, different from other tensors on cuda:0"). This applies that rule: for a fused
    or capturable group, `step` as float32 on the parameter's device; otherwise `step` as it is (torch keeps it on the
    CPU); every other floating tensor in the parameter's dtype and device. ZeRO-3 keeps its optimizer's `params` lists
    empty between steps, so a parameter in no group takes the optimizer's defaults. Integer steps (DeepSpeed's CPU
    Adam) are left alone.
    """
    groups = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    moved = 0
    for param, state in optimizer.state.items():
        if not isinstance(param, torch.Tensor):
            continue
        group = groups.get(id(param), optimizer.defaults)
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "step":
                if not (group.get("fused") or group.get("capturable")):
                    continue
                placed = value.to(dtype=torch.float32, device=param.device)
            elif value.is_floating_point() and param.is_floating_point():
                placed = value.to(dtype=param.dtype, device=param.device)
            else:
                placed = value.to(device=param.device)
            if placed is not value:
                state[key] = placed
                moved += 1
    return moved

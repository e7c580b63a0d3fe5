"""DeepSpeed's checkpoints: a ZeRO checkpoint of another process count converted once with DeepSpeed's own
`ds_to_universal` (sequence-parallel ones included) and loaded as a universal checkpoint; the optimizer state placed
after such a load; LoRA weights rebuilt from ZeRO shards with `zero_to_fp32`."""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path

import torch

from sft.errors import ConfigError

logger = logging.getLogger(__name__)


def ensure_universal(checkpoint: str) -> None:
    """Convert a ZeRO checkpoint with DeepSpeed's `ds_to_universal` (once; the result stays beside the original)."""
    from deepspeed.checkpoint import ds_to_universal

    ckpt = Path(checkpoint)
    if (ckpt / "latest_universal").is_file():
        return
    tag = (ckpt / "latest").read_text().strip()
    args = argparse.Namespace(  # the options of `python -m deepspeed.checkpoint.ds_to_universal`
        input_folder=str(ckpt / tag),
        output_folder=str(ckpt / f"{tag}_universal"),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,  # plain (non-Megatron) DeepSpeed clients do not write the universal info
    )
    logger.info("Converting %s to a universal checkpoint for a different number of processes", ckpt / tag)
    with _sequence_parallel_topology():
        ds_to_universal.main(args)


@contextlib.contextmanager
def _sequence_parallel_topology():
    """Read a sequence-parallel checkpoint's topology from its files. DeepSpeed's Ulysses groups stand in for
    model-parallel ones (`parallel_state_sp`: get_model_parallel_world_size = the sp size), so the checkpoint of an
    sp=2 run records tensor-parallel degree 2 next to its one model-state file, and `ds_to_universal` stops:
    "Checkpoint model-state file count 1 does not match pp_degree=1 * tp_degree=2". Its weights are whole and its ZeRO
    files are one per rank of the partition group, which is what DeepSpeed's reading without the recorded degrees
    finds. A real tensor-parallel checkpoint (one model-state file per tp rank) is read as recorded."""
    from deepspeed.checkpoint import deepspeed_checkpoint
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_TP_DEGREE

    recorded = deepspeed_checkpoint.get_model_3d_descriptor_from_metadata

    def topology(file_list, zero_file_list, model_state_metadata):
        dims = [m.get(CHECKPOINT_PARALLEL_DIMS) or {} for _, m in model_state_metadata]
        if len(model_state_metadata) == 1 and dims[0].get(CHECKPOINT_TP_DEGREE, 1) > 1:
            model_state_metadata = [
                (f, {k: v for k, v in m.items() if k != CHECKPOINT_PARALLEL_DIMS}) for f, m in model_state_metadata
            ]
        return recorded(file_list, zero_file_list, model_state_metadata)

    deepspeed_checkpoint.get_model_3d_descriptor_from_metadata = topology
    try:
        yield
    finally:
        deepspeed_checkpoint.get_model_3d_descriptor_from_metadata = recorded


def loads_universal(config: dict | None) -> bool:
    return bool((config or {}).get("checkpoint", {}).get("load_universal"))


def convert_for_resume(training_args, config: dict | None, checkpoint: str) -> None:
    """If the run loads a universal checkpoint, convert `checkpoint` on the main process while the others wait."""
    if not loads_universal(config):
        return
    with training_args.main_process_first(desc="universal checkpoint conversion"):
        if training_args.process_index == 0:
            ensure_universal(checkpoint)


@contextlib.contextmanager
def universal_load(config: dict | None, sp: int):
    """Around the checkpoint load of a sequence-parallel run that loads a universal checkpoint: DeepSpeed's loader
    asks its model-parallel unit for the tensor-parallel size, which the Ulysses unit (`parallel_state_sp`) does not
    have ("AttributeError: ... has no attribute 'get_tensor_model_parallel_world_size'"). Under SP the weights are
    whole on every rank, so the answer is 1 (each rank loads the full parameters, then its ZeRO partition)."""
    if sp == 1 or not loads_universal(config):
        yield
        return
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    if hasattr(parallel_state_sp, "get_tensor_model_parallel_world_size"):  # a DeepSpeed that has it
        yield
        return
    parallel_state_sp.get_tensor_model_parallel_world_size = lambda: 1
    try:
        yield
    finally:
        del parallel_state_sp.get_tensor_model_parallel_world_size


def lora_state_from_checkpoint(checkpoint: Path) -> dict:
    """A LoRA adapter's weights from a DeepSpeed checkpoint (e.g. ZeRO-3 without 16-bit gathering at save), keyed as
    PEFT saves them; ConfigError if it holds none."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint))
    lora = {k: v for k, v in state.items() if "lora_" in k}
    if not lora:
        raise ConfigError(f"--adapter {checkpoint}: the DeepSpeed checkpoint holds no LoRA weights (no `lora_` keys).")
    # PEFT saves keys without the adapter name: base_model.model.<...>.lora_A.weight
    return {k.replace(".default.", "."): v for k, v in lora.items()}


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

"""DeepSpeed, sft's first engine (`sft.engines.base.Engine`): everything sft asks of DeepSpeed lives in this folder.

- `config.py`: the `--deepspeed` JSON checked and its `"auto"` values resolved; the plan's decisions written in;
- `zero.py`: the process group and `zero.Init` before the model build, ZeRO-3's hooks outside compiled layers, the
  gradient divisor, DeepSpeed's memory equations;
- `checkpoints.py`: universal checkpoints for another process count, the optimizer state after a load, LoRA weights
  from ZeRO shards;
- `ulysses.py`: Ulysses' data-loader adapter and the tiled MLP (DeepSpeed ALST);
- `autoep.py`: expert parallelism (DeepSpeed AutoEP), DeepSpeed's alone.

`DeepSpeed(training_args)` is built once per run (`RunArguments.run_engine`) from the configuration transformers
resolved, and the run asks it; the functions below stay importable for the tests and the command-line tools.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
from pathlib import Path

from sft.engines.base import Engine, Sharding, Spec, Traits
from sft.engines.deepspeed.checkpoints import (  # noqa: F401 (the engine's checkpoint functions, named here)
    base_optimizer,
    convert_for_resume,
    ensure_universal,
    lora_state_from_checkpoint,
    place_optimizer_state,
    universal_load,
)
from sft.engines.deepspeed.config import (  # noqa: F401 (the engine's configuration functions, named here)
    BUCKET_FLOOR,
    OFFLOAD_SECTIONS,
    ONE_PROCESS_BUCKET,
    ZERO3_MEASURED,
    ZeroSetup,
    bucket_elements,
    check_agrees,
    fill_buckets,
    offload_auto,
    place_offload,
    prepare_config,
    read_config,
    universal_load_config,
    unresolved_config,
    zero3_cost,
    zero_setup,
)
from sft.engines.deepspeed.zero import gradient_divisor, hooks_outside_compile, prepare_model_build
from sft.errors import ConfigError

logger = logging.getLogger(__name__)


def sharding_of(config: dict | None) -> Sharding:
    """The ZeRO stage and offloading of a resolved DeepSpeed config (None: DeepSpeed off)."""
    if not config:
        return Sharding()
    zero = config.get("zero_optimization", {})

    def offloaded(key: str) -> bool:
        return str(zero.get(key, {}).get("device", "none")).lower() in ("cpu", "nvme")

    ratio = float((zero.get("offload_optimizer") or {}).get("ratio", 1.0))
    return Sharding(int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param"), ratio)


TRAITS = Traits(
    name="deepspeed",
    label="DeepSpeed",
    resume_flags="--engine deepspeed --deepspeed <its config>",
    config_field="deepspeed",
    reshards_checkpoints=False,
    layer_units=False,
    host_hooks=True,
    shards_weights_always=False,
    float8_all_gather=False,
    sequence_parallel=True,
    expert_parallel=True,
    offload=True,
    eight_bit_moments=True,
    drops_nonfinite_steps=True,
)


def prepare(training_args, dims) -> None:
    """`engine: deepspeed` at parse time: FSDP's fields refused (sft drives FSDP as its own engine), the `deepspeed`
    config checked and its `"auto"` values resolved for the launch (`prepare_config`)."""
    if training_args.fsdp or training_args.fsdp_config:
        raise ConfigError(
            "`fsdp` / `fsdp_config` are FSDP's settings, which sft drives as its second engine: set `engine: "
            "fsdp2` (sft writes fsdp and fsdp_config; `fsdp_config` may keep reshard_after_forward and "
            "cpu_offload), or drop them for DeepSpeed."
        )
    training_args.deepspeed, training_args.resolved_ds_settings = prepare_config(
        training_args.deepspeed, dims.world_size, dims.sp, dims.ep
    )


def wrote(checkpoint: Path) -> bool:
    """A checkpoint DeepSpeed wrote holds its `global_step*` shard folders."""
    return any(p.is_dir() for p in Path(checkpoint).glob("global_step*"))


class DeepSpeed(Engine):
    """The run's DeepSpeed engine, read from the configuration transformers resolved (`hf_deepspeed_config`) once."""

    traits = TRAITS

    def __init__(self, training_args):
        hf = getattr(training_args, "hf_deepspeed_config", None) if training_args.deepspeed else None
        self._config = hf.config if hf is not None else None
        self._sharding = sharding_of(self._config)
        self._dims = training_args.parallel
        self._source = training_args.deepspeed  # the training argument's value: a path, or the dict sft resolved

    @property
    def config(self) -> dict | None:
        return self._config

    @property
    def sharding(self) -> Sharding:
        return self._sharding

    @property
    def expert_parallel(self) -> bool:
        """Whether the run's MoE layers are AutoEP's (its config's `expert_parallel` section is enabled)."""
        return bool(((self._config or {}).get("expert_parallel") or {}).get("enabled"))

    @property
    def experts(self):
        if not self.expert_parallel:
            return None
        from sft.engines.deepspeed import autoep

        return autoep

    def offload_auto(self) -> tuple[bool, bool]:
        return offload_auto(self._source)

    def starting(self) -> str | None:
        if self._config is None:
            return None
        return (
            f"Starting the DeepSpeed engine (ZeRO-{self._sharding.stage}), then training (torch's FutureWarning "
            "that the collectives DeepSpeed calls are deprecated is not shown: harmless, sft.core.logs)"
        )

    def written(self, config, *, offload=None, hidden=None, processes=2, params=None, universal=False,
                keep_experts=False):  # fmt: skip
        lines = []
        if offload is not None and any(offload_auto(config)):  # ZeRO's offload `"auto"`: as the plan decided
            config = place_offload(config, *offload)
            zero = config["zero_optimization"]
            lines += [f"DeepSpeed zero_optimization.{k}: auto -> {json.dumps(zero.get(k))}" for k in OFFLOAD_SECTIONS]
        if hidden is not None:
            config, buckets = fill_buckets(config, hidden, processes, params)
            for key, value in buckets.items():
                why = (
                    f"1 process: one reduction per {value:,} gradients instead of one per hidden^2 = {hidden**2:,}"
                    if processes == 1 and key == "zero_optimization.reduce_bucket_size" and value != BUCKET_FLOOR
                    else f"hidden {hidden}: hidden^2 = {hidden**2:,} would make one collective per "
                    f"{hidden**2 * 4 // 1024} KB"
                )
                lines.append(f"DeepSpeed {key}: auto -> {value:,} elements ({why})")
        if keep_experts:
            from sft.engines.deepspeed import autoep

            config = autoep.keep_layout(read_config(config))
        if universal and config:
            config = universal_load_config(config)
        return config, lines

    def unresolved(self, training_args):
        return unresolved_config(training_args)

    def check_experts(self, ep, sp, family, is_moe, lora, resume=None) -> None:
        from sft.engines.deepspeed import autoep

        offload = self._sharding.offload_optimizer or self._sharding.offload_params
        autoep.check(ep, sp, self._sharding.stage, offload, family, is_moe, lora)
        if resume is not None:
            autoep.check_resume(resume.autoep, ep, resume.checkpoint)

    def sharded_cost(self, params: int, gpus: int):
        return zero3_cost(params, gpus)

    def versions(self) -> dict[str, str]:
        return {"deepspeed": importlib.metadata.version("deepspeed")}

    def prepare_model_build(self) -> bool:
        return prepare_model_build(self._sharding.stage == 3, self._dims.sp)

    def partition_loaded(self, model) -> None:
        from sft.engines.deepspeed.zero import partition

        partition(model)

    def optimizer_created(self, optimizer) -> None:
        from sft.engines.deepspeed.zero import STEP_GROUP_PARAMS, split_optimizer_groups

        # a low-bit optimizer under ZeRO-1/2: its step is bounded by one group's memory, not the whole partition's
        low_bit = type(optimizer).__module__.startswith("torchao")
        if self._sharding.stage in (1, 2) and low_bit and not self._sharding.offload_optimizer:
            added = split_optimizer_groups(optimizer)
            if added:
                logger.info("ZeRO-%d with %s: the optimizer steps groups of at most %.0e parameters (%d groups)",
                            self._sharding.stage, type(optimizer).__name__, STEP_GROUP_PARAMS,
                            len(optimizer.param_groups))  # fmt: skip

    def compiled_layers_ready(self, layers) -> int:
        return hooks_outside_compile(layers) if self._sharding.stage == 3 else 0

    def gradient_divisor(self) -> int:
        return gradient_divisor(self._config, self._sharding.stage, self._dims)

    def sequence_parallel_config(self, dims, attn_implementation: str):
        from sft.engines.deepspeed.ulysses import parallelism_config

        return parallelism_config(dims, attn_implementation)

    def sequence_parallel_loader(self, loader):
        from sft.engines.deepspeed.ulysses import uneven_rows_adapter

        return uneven_rows_adapter(loader)

    def convert_for_resume(self, training_args, checkpoint: str) -> None:
        convert_for_resume(training_args, self._config, checkpoint)

    def loading_checkpoint(self) -> contextlib.AbstractContextManager:
        return universal_load(self._config, self._dims.sp)

    def after_load(self, wrapped_model) -> int:
        optimizer = base_optimizer(wrapped_model)
        moved = place_optimizer_state(optimizer) if optimizer is not None else 0
        if moved:
            logger.info("Placed %d optimizer-state tensors as %s expects them", moved, type(optimizer).__name__)
        return moved


SPEC = Spec(TRAITS, prepare, check_agrees, DeepSpeed, wrote, selected={"engine": "deepspeed"},
            unsharded={"engine": "deepspeed", "deepspeed": None})  # fmt: skip

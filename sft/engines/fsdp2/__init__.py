"""FSDP2, sft's second engine (`sft.engines.base.Engine`): PyTorch's `fully_shard` as accelerate's FSDP2 plugin
applies it, driven by transformers' own `fsdp` / `fsdp_config` training arguments (`fsdp_config.version: 2`).

sft writes the `fsdp_config` (`prepare`): each decoder layer its own FSDP unit (the model's `_no_split_modules`, as
accelerate's transformer-based wrap policy reads them), weights resharded after the forward (ZeRO-3's layout:
parameters, gradients and optimizer states each split over the processes), checkpoints as sharded
torch.distributed.checkpoint folders (`SHARDED_STATE_DICT`: each rank writes its shards; a run of another process
count reads them, resharded). What FSDP2 cannot do that a recipe asks for is refused at parse time: a DeepSpeed config
beside it, DeepSpeed's offload settings, Ulysses sequence parallelism and AutoEP expert parallelism (DeepSpeed's).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
from pathlib import Path

import torch

from sft.engines.base import Engine, Sharding, Spec, Traits
from sft.errors import ConfigError

TRAITS = Traits(
    name="fsdp2",
    label="FSDP2",
    resume_flags="--engine fsdp2 --deepspeed none",
    config_field="fsdp_config",
    reshards_checkpoints=True,
    layer_units=True,
    host_hooks=False,
    shards_weights_always=True,
    float8_all_gather=True,
    sequence_parallel=False,
    expert_parallel=False,
    offload=False,
    eight_bit_moments=False,
    drops_nonfinite_steps=False,
    in_place_of=3,
)
# The fsdp_config sft writes; a recipe's `fsdp_config` may set `reshard_after_forward: false` (ZeRO-2's layout: the
# gathered weights kept from the forward to the backward) and `cpu_offload: true` (FSDP2's CPUOffloadPolicy: weights,
# gradients and optimizer states on the host, the step on the CPU)
DEFAULTS = {"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT",
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "cpu_ram_efficient_loading": False}  # fmt: skip
ALLOWED = {*DEFAULTS, "cpu_offload", "transformer_layer_cls_to_wrap"}
# keys transformers adds to every fsdp_config it resolves, harmless at these values (a resolved config is parsed again
# when the plan rebuilds the training arguments)
NORMALISED = {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}


def prepare_training_args(training_args, dims) -> None:
    """`engine: fsdp2` at parse time: transformers' `fsdp` and `fsdp_config` written (`prepare`), DeepSpeed's off."""
    training_args.fsdp, training_args.fsdp_config = prepare(training_args.deepspeed, training_args.fsdp_config,
                                                            dims.sp, dims.ep)  # fmt: skip
    training_args.deepspeed, training_args.resolved_ds_settings = None, {}


def wrote(checkpoint: Path) -> bool:
    """A checkpoint FSDP2 wrote holds its torch.distributed.checkpoint folder."""
    return (Path(checkpoint) / "pytorch_model_fsdp_0").is_dir()


def prepare(deepspeed, fsdp_config, sp: int = 1, ep: int = 1) -> tuple[bool, dict]:
    """The training arguments `fsdp` and `fsdp_config` for `engine: fsdp2`, the recipe's own `fsdp_config` keys kept
    where FSDP2 honours them; a recipe that asks for what FSDP2 cannot do is refused, naming the field."""
    if deepspeed not in (None, "", "none", "null"):
        raise ConfigError(
            f"`engine: fsdp2` with `deepspeed: {deepspeed}`: the two engines cannot both shard the model. Drop "
            "`deepspeed` (FSDP2 shards as ZeRO-3 does; `fsdp_config: {reshard_after_forward: false}` keeps ZeRO-2's "
            "layout), or set `engine: deepspeed`."
        )
    given = {k.removeprefix("fsdp_"): v for k, v in (fsdp_config or {}).items()}
    unknown = sorted(k for k in set(given) - ALLOWED if not (k in NORMALISED and given[k] == NORMALISED[k]))
    if unknown:
        raise ConfigError(
            f"`fsdp_config`: {', '.join(unknown)} is not something sft's FSDP2 engine honours (it keeps: "
            f"{', '.join(sorted(ALLOWED))}). Remove it; FSDP1's settings (sharding strategies, prefetch, "
            "use_orig_params) have no FSDP2 meaning."
        )
    if int(given.get("version", 2)) != 2:
        raise ConfigError(f"`fsdp_config.version: {given['version']}` with `engine: fsdp2`: set it to 2 or drop it.")
    if sp > 1:
        raise ConfigError(
            f"`sequence_parallel_size: {sp}` with `engine: fsdp2`: sequence parallelism is DeepSpeed's Ulysses in sft "
            "(accelerate's FSDP2 path has none that keeps sft's packed rows exact). Set `engine: deepspeed` for "
            "long rows over several GPUs, or sequence_parallel_size: 1."
        )
    if ep > 1:
        raise ConfigError(
            f"`expert_parallel_size: {ep}` with `engine: fsdp2`: expert parallelism is DeepSpeed's AutoEP. Set "
            "`engine: deepspeed`, or expert_parallel_size: 1 (FSDP2 trains a MoE model with each layer's experts "
            "sharded like any weight)."
        )
    return True, {**DEFAULTS, **given, "version": 2}


class FSDP2(Engine):
    """The run's FSDP2 engine, read from the `fsdp_config` that `prepare` wrote and transformers resolved."""

    traits = TRAITS

    def __init__(self, training_args):
        self._config = dict(training_args.fsdp_config or {})
        offload = bool(self._config.get("cpu_offload", False))
        # FSDP2's layout is ZeRO-3's (reshard after forward) or, without resharding, ZeRO-2's memory for the weights
        stage = 3 if self._config.get("reshard_after_forward", True) else 2
        self._sharding = Sharding(stage, offload, offload)
        self._dims = training_args.parallel

    @property
    def config(self) -> dict:
        return self._config

    @property
    def sharding(self) -> Sharding:
        return self._sharding

    def versions(self) -> dict[str, str]:
        return {"torch": torch.__version__, "accelerate": importlib.metadata.version("accelerate")}

    def offload_auto(self) -> tuple[bool, bool]:
        return False, False

    def starting(self) -> str | None:
        kept = "resharded" if self._config.get("reshard_after_forward", True) else "kept gathered"
        return (
            f"Starting FSDP2 (PyTorch's fully_shard, each decoder layer a unit, weights {kept} after the forward), "
            "then training"
        )

    def written(self, config, *, offload=None, hidden=None, processes=2, params=None, universal=False,
                keep_experts=False):  # fmt: skip
        return config, []  # nothing of the plan goes into FSDP2's configuration

    def unresolved(self, training_args):
        return training_args.fsdp_config  # nothing in it is resolved from `auto`

    def check_experts(self, ep, sp, family, is_moe, lora, resume=None) -> None:
        if ep > 1 or (resume is not None and resume.ep > 1):
            raise ConfigError(
                "expert parallelism is DeepSpeed's AutoEP in sft (and a checkpoint written with it keeps its "
                "experts' layout): set `engine: deepspeed`."
            )

    def accelerator_ready(self, trainer) -> None:
        """Without a GPU accelerate takes the processes for a CPU data-parallel run and drops the FSDP plugin that
        transformers handed it (`AcceleratorState`: FSDP only for GPU-like devices), which would train unsharded
        without a word; torch's `fully_shard` runs on the CPU with gloo, so the plugin is put back."""
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        state = trainer.accelerator.state
        if getattr(state, "fsdp_plugin", None) is None and state.distributed_type == DistributedType.MULTI_CPU:
            state.fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
            state.distributed_type = DistributedType.FSDP
            trainer.is_fsdp_enabled = True
        if not trainer.is_fsdp_enabled or state.fsdp_plugin.fsdp_version != 2:
            raise ConfigError(f"`engine: fsdp2`: accelerate did not take FSDP2 ({state.distributed_type}).")
        head_with_the_decoders_norm()

    def model_state_to_save(self, trainer) -> dict | None:
        """Checkpoints are sharded (`SHARDED_STATE_DICT`), and transformers' `save_model` then writes no weights at
        all; the final model is gathered whole to rank 0's CPU (torch's `get_model_state_dict`, every process) and
        saved as a Hugging Face model directory."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, cpu_offload=True)
        return get_model_state_dict(trainer.model, options=options)

    def prepare_model_build(self) -> bool:
        return False  # built whole on each process; accelerate shards it (`fully_shard`) when the trainer prepares it

    def partition_loaded(self, model) -> None:
        return None

    def compiled_layers_ready(self, layers) -> int:
        return 0

    def gradient_divisor(self) -> int:
        return self._dims.world_size  # FSDP2's reduce-scatter averages over every process

    def sequence_parallel_loader(self, loader):
        raise ConfigError("sequence parallelism needs `engine: deepspeed` (Ulysses).")

    def convert_for_resume(self, training_args, checkpoint: str) -> None:
        return None  # torch.distributed.checkpoint reshards on load for any process count

    def loading_checkpoint(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def after_load(self, wrapped_model) -> int:
        return 0


def head_with_the_decoders_norm() -> None:
    """accelerate gives the output head an FSDP unit of its own together with the final norm, which it looks for
    among the base model's direct children (`_find_final_norm`); a vision-language model keeps it one level deeper
    (`model.language_model.norm`), so the head was left alone in its unit, and on two processes its weight's
    gradient came out wrong while every other one (and the loss) agreed (the demo's Qwen2.5-VL, 2 CPU processes:
    a first gradient norm of 9.235 where one process and ZeRO-2 give 9.243). Where accelerate finds no norm, sft hands
    it the decoder's (`get_decoder().norm`), as it finds for a text model: 9.243 then. Installed once."""
    from accelerate.utils import fsdp_utils

    find = fsdp_utils._find_final_norm
    if getattr(find, "sft_decoder_norm", False):
        return

    def find_with_the_decoder(model: torch.nn.Module):
        found = find(model)
        if found is None:
            decoder = getattr(model, "get_decoder", lambda: None)()
            norm = getattr(decoder, "norm", None)
            found = norm if isinstance(norm, torch.nn.Module) else None
        return found

    find_with_the_decoder.sft_decoder_norm = True
    fsdp_utils._find_final_norm = find_with_the_decoder


SPEC = Spec(TRAITS, prepare_training_args, lambda training_args: None, FSDP2, wrote,
            selected={"engine": "fsdp2", "deepspeed": None, "fsdp": "", "fsdp_config": None})  # fmt: skip

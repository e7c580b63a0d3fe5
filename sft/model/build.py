"""Build the tokenizer and the model: from a hub id or a local directory, or from a config alone (`from_scratch`).

TRL's SFTTrainer can load a model from a name itself; sft builds it here instead so that `from_scratch` (a random
model from `config.json`, used by the demo and the benchmarks) and loaded weights take the same path, under ZeRO-3
too (transformers builds either inside `deepspeed.zero.Init` when the training arguments enable ZeRO-3).
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers import set_seed as hf_set_seed

from sft.config import ModelArguments, TrainConfig
from sft.core.run import RunPlan
from sft.errors import ConfigError
from sft.model import architectures, attention, converters, quantization

logger = logging.getLogger(__name__)


def _dtype(model_args: ModelArguments) -> torch.dtype | str | None:
    if model_args.dtype in (None, "auto"):
        return model_args.dtype
    return getattr(torch, model_args.dtype)


def load_tokenizer(model_args: ModelArguments, training_args: TrainConfig) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(
            model_args.model_name_or_path,
            revision=model_args.model_revision,
            trust_remote_code=training_args.trust_remote_code,
        )
    except OSError as e:
        raise ConfigError(
            f"`model_name_or_path`: no tokenizer could be loaded from {model_args.model_name_or_path!r} ({e}). Give a "
            "local directory with tokenizer files or a reachable hub id."
        ) from e


def load_model(model_args: ModelArguments, plan: RunPlan) -> PreTrainedModel:
    """The model as the run plan decided it: its config, attention backend and engine (partitioned under ZeRO-3),
    then sft's model changes (`sft.model.converters`, in their declared order)."""
    training_args = plan.training_args
    partitioned = plan.engine.prepare_model_build()
    hf_set_seed(training_args.seed)  # the same random init on every rank, and the same as a rerun
    model = _build(model_args, training_args, plan.attn_implementation, partitioned, plan)
    converters.apply_at_build(model, plan)
    return model


def _random(training_args: TrainConfig, partitioned: bool, plan: RunPlan, kwargs: dict):
    """The model with random weights from its config (`from_scratch`), made where it will train: on this rank's GPU
    (seconds for 8B, minutes on the CPU); under ZeRO-3, `zero.Init` partitions them as they are made."""
    config = plan.model_config
    device = training_args.device if torch.cuda.is_available() and not partitioned else "cpu"
    with torch.device(device):
        model = architectures.model_class(config, plan.vision is not None).from_config(
            config,
            attn_implementation=kwargs["attn_implementation"],
            dtype=kwargs["dtype"] if kwargs["dtype"] != "auto" else None,
            trust_remote_code=kwargs["trust_remote_code"],
        )
    logger.info(
        "Built %s from %s/config.json with random weights on %s", type(model).__name__, config.name_or_path, device
    )
    return model


def _build(
    model_args: ModelArguments,
    training_args: TrainConfig,
    attn_implementation: str | None,
    partitioned: bool,
    plan: RunPlan,
):
    config = plan.model_config
    kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": attention.by_submodel(config, attn_implementation),
        "dtype": _dtype(model_args),
    }
    if training_args.model_init_kwargs:
        kwargs.update(training_args.model_init_kwargs)
    if model_args.from_scratch:
        return _random(training_args, partitioned, plan, kwargs)
    sharded = quantization.packed(plan.engine) and not partitioned  # FSDP2 shards the model once it is built
    quantized = quantization.load_kwargs(model_args, training_args, partitioned, sharded)
    kwargs.update(quantized)
    try:
        with quantization.loading(bool(quantized) and (partitioned or sharded)):
            model = architectures.model_class(config, plan.vision is not None).from_pretrained(
                model_args.model_name_or_path, **kwargs
            )
        if quantized and partitioned:
            plan.engine.partition_loaded(model)
    except OSError as e:
        raise ConfigError(
            f"`model_name_or_path`: could not load a model from {model_args.model_name_or_path!r} ({e}). Give a local "
            "model directory or a reachable hub id; for a directory with only config.json, set `from_scratch: true`."
        ) from e
    if quantized:
        layers = sum(1 for m in model.modules() if type(m).__name__ in ("Linear4bit", "Linear8bitLt"))
        logger.info(
            "Loaded %s quantized by bitsandbytes: %d linear layers in %d bits%s",
            type(model).__name__,
            layers,
            4 if model_args.load_in_4bit else 8,
            f" (packed in {quantization.zero3_storage(training_args)}; loaded in host memory, then partitioned by "
            "ZeRO-3 one weight at a time)"
            if partitioned
            else f" (packed in {quantization.zero3_storage(training_args)}; loaded in host memory, then sharded by "
            "FSDP2 one layer at a time)"
            if sharded
            else "",
        )
    return model

"""What sft's memory plan and FLOP count read from a model: its shape (`ModelShape`), from a config.json, a model
directory, a hub id or one of the configs sft ships (`model_configs.json`, for machines without the hub). The model is
built on the meta device; no weights are read.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from sft.core.dims import is_routed_expert
from sft.errors import ConfigError
from sft.model.architectures import LayerKeeps

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """What the memory equations need from a model, read from its config (the model is built on the meta device)."""

    model_type: str
    n_params: int
    largest_module_params: int  # DeepSpeed's "largest layer": the most parameters held directly by one module
    decoder_layer_params: int
    linear_params: int  # in the decoder layers' nn.Linear modules: what QLoRA stores in 4 bits
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # MLP activations per token (`sft.model.architectures`: the active experts' width for MoE)
    vocab: int
    tied: bool
    # mixture of experts (`sft.model.architectures.Experts`): (experts, active per token, MoE layers); None: dense
    experts: tuple[int, int, int] | None = None
    expert_params: int = 0  # the routed experts' weights (what expert parallelism splits)
    mlp_kept: int = 4  # [tokens, intermediate] tensors the MLP keeps (`sft.model.architectures.Architecture.mlp_kept`)
    param_sizes: tuple[int, ...] = ()  # each parameter's size, in the model's order (DeepSpeed's sub-groups)
    frozen_params: int = 0  # weights that stay frozen in full fine-tuning: a vision encoder (`train_vision_tower`)
    # Liger's tokens/s against plain bf16's at one micro batch, measured on this family (`Kernel.speedup`; 1: not
    # measured apart, as on Llama, whose speed constants were fitted with Liger on)
    liger_speedup: float = 1.0
    # what a decoder layer keeps besides attention's and the MLP's tensors (`sft.model.architectures.LayerKeeps`)
    keeps: LayerKeeps = LayerKeeps()
    # layers whose heads are wider than FlashAttention takes, and that width (Gemma 4's full layers: 512)
    wide_layers: int = 0
    wide_head_dim: int = 0

    def trainable(self, lora_r: int = 0) -> int:
        """Parameters that train: LoRA rank `lora_r`'s adapters, or (0) every one but the frozen ones."""
        return self.lora_params(lora_r) if lora_r else self.n_params - self.frozen_params

    def lora_params(self, r: int) -> int:
        """Trainable parameters of LoRA rank r on every linear layer of the decoder (`all-linear`)."""
        h, hq, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        per_layer = (h + hq) + 2 * (h + kv) + (hq + h) + 2 * (h + i) + (i + h)
        return r * per_layer * self.layers


SHIPPED_CONFIGS = Path(__file__).with_name("model_configs.json")
HUB_PROBE_SECONDS = 3.0


def shipped_config(model: str) -> dict | None:
    """The architecture of a common hub model shipped with sft (Llama 3.x, Qwen2.5/3, Qwen2.5-VL, Mistral, Gemma 2/3,
    ...), so the planner needs no network for them; `-Instruct`/`-it` variants have their base model's shape. Keys
    starting with `_` are sft's notes on the entry (`shipped_note`), not config fields."""
    entry = _shipped_entry(model)
    return None if entry is None else {k: v for k, v in entry.items() if not k.startswith("_")}


def shipped_note(model: str) -> str | None:
    """What sft's shipped config of `model` leaves out, where it does (`_text_only`: an image+text checkpoint planned
    as its text model), else None."""
    entry = _shipped_entry(model)
    return None if entry is None else entry.get("_text_only")


def _shipped_entry(model: str) -> dict | None:
    configs = {key.lower(): value for key, value in json.loads(SHIPPED_CONFIGS.read_text()).items()}
    name = model.strip().lower()
    for suffix in ("", "-instruct", "-it"):
        if suffix and name.endswith(suffix) and name[: -len(suffix)] in configs:
            return configs[name[: -len(suffix)]]
        if not suffix and name in configs:
            return configs[name]
    return None


def _hub_reachable() -> str | None:
    """None if the hub answers a TCP connection within a few seconds, else why not (offline mode, no route)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("TRANSFORMERS_OFFLINE") == "1":
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_SECONDS).close()
    except OSError as e:
        return f"{url.hostname} did not answer within {HUB_PROBE_SECONDS:.0f} s: {e}"
    return None


def load_config(model: str, trust_remote_code: bool = False):
    """A transformers config from a config.json, a model directory, a shipped hub id, or the hub (config only)."""
    from transformers import AutoConfig

    path = Path(model)
    shipped = None if path.exists() else shipped_config(model)
    try:
        if path.is_file():
            return AutoConfig.for_model(**json.loads(path.read_text()))
        if path.is_dir():
            return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        if shipped is not None:
            return AutoConfig.for_model(**shipped)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise ConfigError(f"memory plan: cannot read a model config from {model!r} ({e}).") from e
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:  # a path, not an owner/name hub id
        raise ConfigError(
            f"memory plan: cannot read a model config from {model!r}: no such file or directory. Give a config.json, "
            "a model directory, or a hub id (owner/name)."
        )
    names = ", ".join(key for key in json.loads(SHIPPED_CONFIGS.read_text()) if not key.startswith("_"))
    if "/" not in model:
        raise ConfigError(
            f"memory plan: {model!r} is neither a file, a directory nor a hub id (owner/name). Give a config.json, "
            f"a model directory, or one of the models sft knows offline: {names}."
        )
    offline = _hub_reachable()
    if offline:
        try:  # the hub's cache may hold it
            return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code, local_files_only=True)
        except (OSError, ValueError):
            pass
        raise ConfigError(
            f"memory plan: {model!r} is a hub id sft has no config for, and the hub cannot be reached ({offline}). "
            f"Give its config.json or model directory, or one of the models sft knows offline: {names}."
        )
    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"memory plan: the hub has no readable config for {model!r} ({e}).") from e


def load_shape(
    model: str, trust_remote_code: bool = False, config=None, arch=None, frozen_vision: bool = False
) -> ModelShape:
    """A ModelShape from a config.json, a model directory or a hub id (config only; no weights are read); a run
    passes the `config` and `arch` it has decided already, and whether a vision family's encoder stays frozen."""
    import torch

    from sft.engines import outside_sharded_init
    from sft.model import architectures

    config = config if config is not None else load_config(model, trust_remote_code)
    arch = arch if arch is not None else architectures.of(config)
    with outside_sharded_init(), torch.device("meta"):
        built = architectures.model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    unique = {id(p): p.numel() for p in built.parameters()}
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in built.modules())
    decoder_layers = list(architectures.decoder_layers(built) or ())
    layer_params = sum(p.numel() for p in decoder_layers[0].parameters()) if decoder_layers else 0
    linear = sum(
        m.weight.numel() for layer in decoder_layers for m in layer.modules() if isinstance(m, torch.nn.Linear)
    )
    routed = sum(p.numel() for name, p in built.named_parameters() if is_routed_expert(name))
    layer_modules = decoder_layers[0].named_modules() if decoder_layers else ()
    return ModelShape(
        model_type=arch.family,
        n_params=sum(unique.values()),
        largest_module_params=largest,
        decoder_layer_params=layer_params,
        linear_params=linear,
        hidden=arch.hidden,
        layers=arch.layers,
        heads=arch.heads,
        kv_heads=arch.kv_heads,
        head_dim=arch.head_dim,
        intermediate=arch.mlp_width,
        vocab=arch.vocab,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
        experts=(arch.experts.count, arch.experts.active, arch.experts.moe_layers) if arch.experts else None,
        expert_params=routed if arch.experts else 0,
        mlp_kept=arch.mlp_kept,
        param_sizes=tuple(unique.values()),
        frozen_params=sum(
            p.numel()
            for _, p in [
                *(architectures.vision_tower_parameters(built) if frozen_vision else ()),
                *architectures.unbuilt_input_parameters(built),
            ]
        ),
        liger_speedup=arch.kernel("liger").speedup or 1.0,
        keeps=architectures.layer_keeps(arch.family, [n for n, _ in layer_modules], architectures.text_config(config)),
        wide_layers=arch.attention.wide_heads,
        wide_head_dim=max(arch.attention.head_dims) if arch.attention.wide_heads else 0,
    )


def parameter_names(config, trust_remote_code: bool = False) -> list[str]:
    """The names of a model's parameters, from a model built on the meta device (no memory, no weights read)."""
    import torch

    from sft.engines import outside_sharded_init
    from sft.model import architectures

    with outside_sharded_init(), torch.device("meta"):
        built = architectures.model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    return [name for name, _ in built.named_parameters()]

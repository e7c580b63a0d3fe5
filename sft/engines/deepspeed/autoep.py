"""Expert parallelism: a mixture-of-experts model's experts spread over GPUs with DeepSpeed AutoEP.

`expert_parallel_size: N` (a recipe field, default 1) splits each MoE layer's experts over N processes: every rank
keeps count/N experts and its tokens travel to the experts they are routed to by all-to-all, inside DeepSpeed's
`AutoEPMoELayer` (DeepSpeed 0.19's AutoEP, which replaces the Hugging Face MoE block at `deepspeed.initialize` for the
families it has a preset for: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, ...). The expert ranks are also data-parallel
ranks (each reads its own data), so the batch arithmetic is unchanged (`sft.core.dims.ParallelDims.ep` divides
`dp`); the experts' weights, gradients and (ZeRO-1/2) optimizer states are split N ways (`sft.plan.memory`).

What sft adds around DeepSpeed's AutoEP, and why:
- `deepspeed_section` / `check`: the recipe field written into the DeepSpeed config, and everything AutoEP would
  refuse deep inside `deepspeed.initialize` (a family without a preset, ZeRO-3, a size that does not divide the
  processes, LoRA) refused before the model loads, naming the field and the fix;
- `compatible_output_registry`: DeepSpeed 0.19.8's AutoEP re-points transformers' router-logit recorders and calls
  `_CAN_RECORD_REGISTRY.get(key, default)`, a dict's signature; transformers 5.24's registry is a dict subclass whose
  `get` takes one argument ("TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given").
  The registry is replaced by one that answers both calls (same entries, transformers' own calls unchanged);
- `hf_state_dict`: a model to save in Hugging Face's layout. AutoEP's layers hold this rank's experts as
  `experts.w1/w2/w3` [local experts, ...] and the router as `router.gate`; the saved model (and every checkpoint's
  model.safetensors) must load with `from_pretrained`, so the experts are gathered over the expert group and put back
  as `experts.gate_up_proj` / `experts.down_proj` in the layout the model was built with (the inverse of DeepSpeed's
  `moe.ep_repack`).

Resuming on another process count or expert-parallel size goes through DeepSpeed's universal checkpoint, which
knows AutoEP's expert placement (`deepspeed.checkpoint.autoep_universal`), as for data parallelism
(`sft.engines.deepspeed.convert_for_resume`).
"""

from __future__ import annotations

import torch

from sft.core.dims import is_routed_expert
from sft.errors import ConfigError


def preset_for(family: str) -> str | None:
    """DeepSpeed AutoEP's preset for a transformers model_type (None: AutoEP cannot split this family's experts)."""
    from deepspeed.module_inject.auto_ep_presets.registry import preset_name_for_hf_model_type

    return preset_name_for_hf_model_type(family)


def preset_families() -> list[str]:
    from deepspeed.module_inject.auto_ep_presets.registry import PRESET_MODELS

    return sorted({t for p in PRESET_MODELS.values() for t in p.hf_model_types})


def deepspeed_section(ep: int) -> dict:
    """The DeepSpeed config's `expert_parallel` section for `expert_parallel_size: ep` (the preset is found from the
    model's model_type by AutoEP itself)."""
    return {"enabled": True, "autoep_size": ep}


def check(ep: int, sp: int, zero_stage: int | None, offload: bool, family: str, is_moe: bool, lora: bool) -> None:
    """Refuse, before the model loads, an expert-parallel setting AutoEP cannot run (or sft cannot save); that `ep`
    divides the data-parallel size is `sft.core.dims`'s check."""
    if ep == 1:
        return
    field = f"`expert_parallel_size: {ep}`"
    if not is_moe:
        raise ConfigError(f"{field}: {family} is a dense model (no experts to split). Remove the field.")
    if preset_for(family) is None:
        raise ConfigError(
            f"{field}: DeepSpeed AutoEP has no preset for {family}, so it cannot split this model's experts. It has "
            f"presets for {', '.join(preset_families())}; for {family} set expert_parallel_size: 1."
        )
    if zero_stage is None:
        raise ConfigError(
            f"{field} runs through DeepSpeed AutoEP: pass a DeepSpeed config (ds_configs/zero2.json), not "
            "`--deepspeed none`."
        )
    if zero_stage == 3:
        raise ConfigError(
            f"{field} with ZeRO-3: sft saves the model in Hugging Face's layout by gathering each MoE layer's experts "
            "over the expert group, which it does for ZeRO-0/1/2 only (under ZeRO-3 AutoEP partitions the experts "
            "again). Use ds_configs/zero2.json."
        )
    if offload:
        raise ConfigError(
            f"{field} with ZeRO offload: AutoEP's expert groups with the optimizer on the CPU were not run in sft. "
            "Use ds_configs/zero2.json (experts split over GPUs need less memory per GPU already)."
        )
    if sp > 1:
        raise ConfigError(
            f"{field} with sequence_parallel_size {sp}: AutoEP's all-to-all over the experts and Ulysses' over the "
            "sequence were not run together in sft. Use one of the two."
        )
    if lora:
        raise ConfigError(
            f"{field} with LoRA (use_peft): peft's adapters wrap the Hugging Face expert weights, which AutoEP "
            "replaces with its own grouped layer at start. Train LoRA with expert_parallel_size: 1."
        )


def prepare_config(config: dict, ep: int, where: str) -> dict:
    """The DeepSpeed config with AutoEP set from `expert_parallel_size`; a config's own `expert_parallel` section must
    agree with the field (one owner: the recipe)."""
    own = config.get("expert_parallel")
    if own is not None:
        own_size = own.get("autoep_size", 1) if own.get("enabled") else 1
        if own_size != ep:
            raise ConfigError(
                f"`deepspeed`: {where} sets expert_parallel (autoep_size {own_size}) and the recipe sets "
                f"expert_parallel_size {ep}. Set the size once, with expert_parallel_size, and remove the section "
                "from the DeepSpeed config."
            )
    if ep > 1:
        config["expert_parallel"] = {**(own or {}), **deepspeed_section(ep)}
    return config


def keep_layout(config: dict) -> dict:
    """The DeepSpeed config (a copy, `config.read_config`'s) of a run that resumes a checkpoint written with AutoEP at
    `expert_parallel_size: 1`: AutoEP stays on at size 1 (every rank holds every expert, in AutoEP's layer), so that
    the ZeRO checkpoint's parameters (AutoEP's `experts.w1/w2/w3`, `router.gate`) are the model's, and DeepSpeed's
    universal checkpoint gives each rank its experts."""
    config["expert_parallel"] = {**(config.get("expert_parallel") or {}), **deepspeed_section(1)}
    return config


def check_resume(saved_autoep: bool, now_ep: int, checkpoint: str) -> None:
    """A checkpoint written without AutoEP holds the experts in Hugging Face's layout, which AutoEP's layers cannot
    load from DeepSpeed's files."""
    if now_ep > 1 and not saved_autoep:
        raise ConfigError(
            f"`expert_parallel_size: {now_ep}`: {checkpoint} was written without expert parallelism, and its ZeRO "
            "files hold the experts in Hugging Face's layout, not AutoEP's. Resume it with expert_parallel_size: 1, "
            "or start a new run (new --output_dir) from its model.safetensors with expert parallelism."
        )


def compatible_output_registry() -> None:
    """Make transformers' router-logit recorder registry answer DeepSpeed AutoEP's `get(key, default)` (see the
    module docstring); a no-op where the registry already does."""
    from transformers.utils import output_capturing

    registry = output_capturing._CAN_RECORD_REGISTRY
    try:
        registry.get("", None)
        return
    except TypeError:
        pass

    class Registry(type(registry)):
        def get(self, key, *default):
            if isinstance(key, str):  # DeepSpeed's call: keyed by str(module class), like the entries themselves
                return dict.get(self, key, *default)
            return super().get(key)

    compatible = Registry()
    dict.update(compatible, registry)
    output_capturing._CAN_RECORD_REGISTRY = compatible


def group_experts(optimizer: torch.optim.Optimizer, model: torch.nn.Module, ep: int) -> int:
    """Put the experts' weights in optimizer groups of their own, marked as DeepSpeed's MoE groups (`moe`, and the
    expert group's name `ep_size_<ep>`, as `deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer`
    writes them), each beside the group it came from with the same hyperparameters. transformers' Trainer builds its
    optimizer before `deepspeed.initialize` replaces the MoE layers, so the experts' new tensors cannot be marked yet;
    DeepSpeed then puts each replacement in the group of the weights it was built from
    (`_remap_client_optimizer_after_module_replacement`), which is this one, and ZeRO reduces and partitions it over
    the expert-data-parallel group ("The model has moe layers, but None of the param groups are marked as MoE"
    otherwise). Returns the number of expert weights moved."""
    experts = {id(p) for name, p in model.named_parameters() if is_routed_expert(name)}
    moved = []
    for group in optimizer.param_groups:
        own = [p for p in group["params"] if id(p) in experts]
        if own:
            group["params"] = [p for p in group["params"] if id(p) not in experts]
            moved.append({**group, "params": own, "moe": True, "name": f"ep_size_{ep}"})
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]] + moved
    return sum(len(g["params"]) for g in moved)


def layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """AutoEP's MoE layers of a model by module path (none before `deepspeed.initialize`, or without AutoEP)."""
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except ImportError:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, AutoEPMoELayer)}


def hf_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The model's parameter names and shapes in Hugging Face's layout (taken before AutoEP replaces its layers)."""
    return {name: p.shape for name, p in model.state_dict().items()}


def _gather(tensor: torch.Tensor, group) -> torch.Tensor:
    """This rank's experts joined with the other expert ranks' along dim 0 (expert order = rank order)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts)


def hf_state_dict(model: torch.nn.Module, shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The model's state dict in Hugging Face's layout (`shapes`), the experts of every AutoEP layer gathered over its
    expert group. Called on every rank (the gather is collective)."""
    replaced = layers(model)
    state = model.state_dict()
    if not replaced:
        return state
    out = {k: v for k, v in state.items() if not any(k.startswith(p + ".") for p in replaced)}
    for prefix, layer in replaced.items():
        w1, w2, w3 = (_gather(getattr(layer.experts, n).detach(), layer.ep_group) for n in ("w1", "w2", "w3"))
        gate_up, down = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        if shapes[gate_up] == (w1.shape[0], 2 * w1.shape[1], w1.shape[2]):  # [E, 2 x ffn, hidden]: gate rows first
            out[gate_up], out[down] = torch.cat([w1, w3], dim=1), w2
        else:  # transformers' other fused layout [E, hidden, 2 x ffn]
            out[gate_up], out[down] = torch.cat([w1, w3], dim=1).transpose(1, 2), w2.transpose(1, 2)
        own = {k[len(prefix) + 1 :]: v for k, v in state.items() if k.startswith(prefix + ".")}
        for name in (n for n in shapes if n.startswith(prefix + ".") and n not in (gate_up, down)):
            rest = name[len(prefix) + 1 :]
            # the router: AutoEP's `router.gate.weight` (and its alias under the HF name, `gate.gate.weight`)
            candidates = (rest, "router." + rest, "router." + rest.split(".", 1)[-1])
            found = next((own[c] for c in candidates if c in own and own[c].shape == shapes[name]), None)
            if found is None:
                raise RuntimeError(f"AutoEP layer {prefix} has no tensor for {name} (it has {sorted(own)})")
            out[name] = found
    missing = set(shapes) - set(out)
    if missing:
        raise RuntimeError(f"Saving the AutoEP model in Hugging Face's layout left out {sorted(missing)[:5]}")
    for name, shape in shapes.items():
        if out[name].shape != shape:
            raise RuntimeError(f"{name}: {tuple(out[name].shape)} after the gather, {tuple(shape)} in the model")
    return {name: out[name] for name in shapes}

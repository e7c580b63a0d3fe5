"""DeepSpeed's ZeRO around the model: the process group and `zero.Init` before the build, a model loaded whole then
partitioned, ZeRO-3's hooks kept out of compiled layers, the gradient divisor, and DeepSpeed's memory equations for the
plan."""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)


def skip_cpu_shared_memory_op() -> None:
    """Without a GPU, keep DeepSpeed from compiling and loading its shared-memory all-reduce op
    (`deepspeed_shm_comm`) when its process group starts. The op serves only DeepSpeed's `inference_all_reduce`, which
    training never calls (ZeRO's collectives are torch's, over gloo). Compiled, it costs a run 43 s the first time on
    a machine (2 cores), and every later run takes torch's build lock for it: a process killed holding that lock
    leaves the lock file, and each run after it waits on the file forever (torch's `FileBaton`). DeepSpeed asks
    `deepspeed.ops.__compatible_ops__` before it builds; the entry is set there."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def prepare_model_build(stage3: bool, sp: int) -> bool:
    """Before the model is built: under ZeRO-3 or sequence parallelism start DeepSpeed's process group, which
    `zero.Init` and the Ulysses groups need (on CPU it must be gloo: without it `zero.Init` starts one itself and
    fails with a batch-size/world-size mismatch). Returns whether the model is built partitioned (inside
    `zero.Init`). On CPU, whether or not the group starts here, DeepSpeed's shared-memory op is kept out first
    (`skip_cpu_shared_memory_op`)."""
    skip_cpu_shared_memory_op()
    if not stage3 and sp == 1:
        return False
    import deepspeed

    logger.info(
        "Starting DeepSpeed's process group, then building the model%s",
        " inside deepspeed.zero.Init (ZeRO-3 partitions the weights as they are made)" if stage3 else "",
    )
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return stage3


# ZeRO-1/2 steps its optimizer one parameter group at a time (the group's flat fp32 gradient made, stepped, freed); a
# low-bit optimizer (torchao's 8-bit AdamW) also dequantizes the moments of each flat tensor whole at its step (8.03
# bytes an element, benchmarks/results/optimizer_step_memory). Groups of at most this many parameters bound both, as
# ZeRO-3's `sub_group_size` (the same default) does (`sft.plan.memory` counts one group at the step).
STEP_GROUP_PARAMS = 1_000_000_000


def split_optimizer_groups(optimizer: torch.optim.Optimizer, limit: int = STEP_GROUP_PARAMS) -> int:
    """Split each of the optimizer's parameter groups into groups of at most `limit` parameters (in the model's order,
    a parameter never cut; each with its group's hyperparameters), before DeepSpeed flattens them; returns the number
    of groups added. Only for a low-bit optimizer under ZeRO-1/2 (the caller decides): its step's transient memory is
    one group's, not the whole partition's."""
    groups = []
    for group in optimizer.param_groups:
        chunk, size = [], 0
        for param in group["params"]:
            if chunk and size + param.numel() > limit:
                groups.append({**group, "params": chunk})
                chunk, size = [], 0
            chunk.append(param)
            size += param.numel()
        groups.append({**group, "params": chunk})
    added = len(groups) - len(optimizer.param_groups)
    optimizer.param_groups[:] = groups
    return added


def hooks_outside_compile(layers) -> int:
    """Under ZeRO-3 with compiled decoder layers: every ZeRO-3 forward hook inside `layers` (gather before, release
    and the backward hooks after each submodule) runs eagerly, outside torch.compile; the number of hooks wrapped.

    Traced, these hooks are Python bookkeeping keyed on each module (its `ds_id`, type, the stack depth): dynamo
    recompiles them per module until its recompile limit (measured on the demo: 1,012 recompile lines in 3 steps) and
    failed on the GPU inside Liger's SwiGLU (`benchmarks/results/fp8/call3_zero3`). Eager, each hook is one graph
    break, and the compiled pieces between them hold the elementwise work (norms, RoPE, float8 casts).
    """
    import deepspeed.utils.nvtx

    deepspeed.utils.nvtx.enable_nvtx = False  # what `DeepSpeedEngine.compile` does: its wrapper breaks graphs
    wrapped = 0
    for layer in layers:
        for module in layer.modules():
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(hooks.items()):
                    if not getattr(hook, "_sft_eager", False):
                        eager = torch.compiler.disable(hook)
                        eager._sft_eager = True
                        hooks[key] = eager
                        wrapped += 1
    return wrapped


def gradient_divisor(config: dict | None, stage: int | None, dims) -> int:
    """What DeepSpeed divides the sum of all ranks' gradients by under sequence parallelism.

    ZeRO-1/2 (`stage_1_and_2.py`) and ZeRO-3's contiguous-bucket path (`__avg_scatter_contiguous_grads`) divide by
    `world / sequence_parallel_size`, the data-parallel size. ZeRO-3's reduce-scatter path (`__avg_scatter_grads`,
    taken whenever `reduce_scatter` is on, its default) averages over the whole partition group, the world size,
    without that correction: measured on the demo, the same step's grad norm is half (sp = 2) of ZeRO-2's.
    """
    zero = (config or {}).get("zero_optimization", {})
    if stage == 3 and zero.get("reduce_scatter", True):
        return dims.world_size
    return dims.dp


@contextlib.contextmanager
def outside_zero_init():
    """Build a model normally even while a ZeRO-3 config is live (transformers would build it inside `zero.Init`):
    the memory planner builds its shapes on the meta device."""
    from transformers.integrations import deepspeed as hf_deepspeed

    live = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = live


def partition(model: torch.nn.Module) -> None:
    """Under ZeRO-3, a model loaded in host memory (`sft.model.build.quantization.loading`) partitioned now, one weight
    at a time, as if it had been built inside `deepspeed.zero.Init`. Without this DeepSpeed's engine, finding no
    parameter ZeRO has seen, moves the whole model to the GPU first (`module.to(device)`; measured: 20.55 GiB per GPU
    at 40 layers of 70B width on 2 GPUs, benchmarks/results/qlora_70b_2gpu/run_40_fit_2x24_2gpu.log)."""
    import deepspeed
    from transformers.integrations.deepspeed import deepspeed_config

    # mem_efficient_linear off: with `module` given, zero.Init would patch torch's linear for good
    deepspeed.zero.Init(module=model, config_dict_or_path=deepspeed_config(), mem_efficient_linear=False)


def model_states(
    params: float,
    largest_module: int,
    per_node: int,
    nodes: int,
    stage: int,
    offload_optimizer: bool,
    offload_params: bool,
) -> tuple[float, float] | None:
    """DeepSpeed's own equations for the model states of `params` trainable parameters: (GPU, CPU) bytes per process
    for ZeRO-2 and ZeRO-3; None for other stages (the plan's own terms)."""
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest_module, per_node, nodes, offload_optimizer, offload_params
        )
        return gpu, cpu
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        cpu, gpu = estimate_zero2_model_states_mem_needs(params, per_node, nodes, offload_optimizer)
        return gpu, cpu
    return None

"""sft: TRL's SFTTrainer with DeepSpeed, packing, a memory plan, exact resume, sequence parallelism and FP8."""

import logging as _logging

# torchao, imported by accelerate/TRL whenever it is installed (the `fp8` extra), warns at import about CUDA
# extensions built for another torch and about a deprecated pytree registration; float8 training uses neither.
# Silenced before anything imports it, so every run's log stays free of them. bitsandbytes (the `qlora` extra,
# imported by peft/transformers) warns at import on CPUs with AVX-512 BF16 that it cannot fetch an optional CPU 4-bit
# kernel from the hub (`kernels-community`); its own kernels run instead. Since transformers 5.25 installs `kernels`,
# that fetch offline (HF_HUB_OFFLINE) also warns from `kernels` that it skips the publisher check of that repository:
# that one message is dropped, the logger's others stay.
for _name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)
_BITSANDBYTES_HUB_KERNEL = "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'"
_logging.getLogger("kernels._internals.hf_hub").addFilter(
    lambda record: not str(record.msg).startswith(_BITSANDBYTES_HUB_KERNEL)
)

"""sft: TRL's SFTTrainer with DeepSpeed, packing, a memory plan, exact resume, sequence parallelism and FP8."""

import logging as _logging

# torchao, imported by accelerate/TRL whenever it is installed (the `fp8` extra), warns at import about CUDA
# extensions built for another torch and about a deprecated pytree registration; float8 training uses neither.
# Silenced before anything imports it, so every run's log stays free of them. bitsandbytes (the `qlora` extra,
# imported by peft/transformers) warns at import on CPUs with AVX-512 BF16 that it cannot fetch an optional CPU 4-bit
# kernel from the hub (`kernels-community`); its own kernels run instead.
for _name in ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

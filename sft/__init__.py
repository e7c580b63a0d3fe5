"""sft: TRL's SFTTrainer with DeepSpeed, packing, a memory plan, exact resume, sequence parallelism and FP8."""

import logging as _logging

# torchao, imported by accelerate/TRL whenever it is installed (the `fp8` extra), warns at import about CUDA
# extensions built for another torch and about a deprecated pytree registration; float8 training uses neither.
# Silenced before anything imports it, so every run's log stays free of them.
for _name in ("torchao", "torch.utils._pytree"):
    _logging.getLogger(_name).setLevel(_logging.ERROR)

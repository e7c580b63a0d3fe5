"""What a run prints: log levels per rank, known-harmless library warnings, progress bars or plain lines.

One owner for the console, called once by `sft.train` right after the arguments are parsed (`setup`):

- sft's own messages at info from the main process, errors only from the others; transformers' and datasets'
  loggers at the levels the training arguments give (`log_level`, `log_level_replica`);
- the other ranks' standard output (DeepSpeed's bare `print`s: "deepspeed_shm_comm_op built successfully", ...) goes
  to /dev/null unless `log_level_replica` is `info` or `debug`; their standard error (warnings, errors, tracebacks)
  stays;
- warnings that torch raises on every call of a collective DeepSpeed makes (`reduce_scatter_tensor`,
  `all_gather_into_tensor` "is deprecated": 8,300 lines in a 60-step ZeRO-3 demo) are filtered, with one line
  saying so (`HARMLESS_WARNINGS`); two libraries' loggers that print harmless tracebacks on GPUs are raised to
  ERROR (`QUIET_LOGGERS`);
- without a terminal (a log file, CI, a pipe) there are no progress bars, which there write carriage returns and
  cursor-up escape codes; each training log is one plain line instead (transformers' `disable_tqdm`).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

logger = logging.getLogger("sft")

# (category, message regex): warnings raised inside torch/DeepSpeed on every call, about code that is not sft's
HARMLESS_WARNINGS = (
    # torch 2.13 deprecates the `*_tensor` collectives that DeepSpeed's ZeRO-2/3 call on every step and save
    (FutureWarning, r"`torch\.distributed\.\w+` is deprecated"),
)
# loggers of other libraries that print harmless tracebacks or notices at WARNING, raised to ERROR (measured on the
# GPU machine, benchmarks/results/fp8/call4_8b_2gpu: 7,292 log lines for a 7-step compiled FP8 run, 49 without)
QUIET_LOGGERS = {
    # torch.compile reading Liger's Triton kernels: "Encountered an exception in identify_mutated_tensors, assuming
    # every input is mutated" plus a 25-line traceback per kernel and rank (the kernel then runs as it is)
    "torch._higher_order_ops.triton_kernel_wrap": logging.ERROR,
    # Liger's optional backends (CuTe DSL, Ascend) that are not installed: "Backend impl ... could not be imported"
    "liger_kernel.backends.registry": logging.ERROR,
}
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def is_terminal() -> bool:
    return sys.stderr.isatty()


def setup(training_args) -> None:
    """Levels, per-rank output, harmless warnings and progress display for this process (see the module doc)."""
    import datasets
    import transformers

    main = training_args.process_index == 0
    level = training_args.get_process_log_level()
    logging.basicConfig(format=LOG_FORMAT, level=level, force=True)
    logger.setLevel(logging.INFO if main else logging.ERROR)
    datasets.utils.logging.set_verbosity(level)
    transformers.utils.logging.set_verbosity(level)
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, quiet in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(max(quiet, level))
    if not main and level > logging.INFO:
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout from here on)
    if not main or not is_terminal():
        datasets.utils.logging.disable_progress_bar()
        transformers.utils.logging.disable_progress_bar()
    if not is_terminal():
        training_args.disable_tqdm = True  # transformers prints each log as one line instead of a progress bar


def quiet_accelerator_detection() -> None:
    """Without a GPU, tell DeepSpeed it is the CPU before it looks: otherwise every process that imports it warns
    "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")

"""How a process of sft ends: its exit handlers, then its exit code, without the interpreter's teardown (`leave`).
Light on purpose (the standard library only): the `sft` command leaves through it after commands that never import
torch."""

from __future__ import annotations

import atexit
import os
import sys


def leave(code: int) -> None:
    """Exit with `code` after the exit handlers, without the interpreter's teardown.

    The exit handlers (logging, wandb, tensorboard, temporary files) run and the standard streams are flushed; only
    the teardown of what is left, which nothing of a finished run needs, is skipped, for two reasons:
    - The gloo process groups outlive `destroy_process_group` (DeepSpeed, among others, keeps references to them):
      after `main` returns, each rank of a multi-process run still runs their worker and transport threads, which go
      down only with the interpreter's teardown. There a rank sometimes aborts ("terminate called without an active
      exception", SIGABRT) after a run that finished and saved everything, and torchrun reports the run as failed: CI
      saw it on 2 of its 2-process runs, a local loop of a 2-process ZeRO-3 LoRA run 1 time in 20. The likely
      mechanism, as pytorch/pytorch#179291 describes it (its fix is not in torch): a worker thread frees the last
      reference to a tensor while the interpreter is finalising and can no longer take the GIL.
    - The teardown of the ~4,900 modules torch, transformers, DeepSpeed and the rest import costs a one-process demo
      run 3-4 CPU-seconds on this project's 2-core CI machine (14-20 s with it, 12.5-14.4 s without, 2 steps).
    No process group is destroyed first: NCCL's warning of a group never destroyed comes from its destructor, which
    runs only in that teardown. The `sft` command leaves this way too (`sft.cli.run`): its teardown walked every
    object of the modules a command imported (`sft plan` on 2 cores: 12.4-12.7 s with it, 9.4-10.9 s with them
    frozen), and printed Triton's `nanobind: leaked N instances!` lines under the command's output.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)

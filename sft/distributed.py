"""Process-group set-up that survives elastic restarts.

Under `torchrun --max-restarts N`, the restarted workers of torch 2.13 reach the agent's TCPStore, which still holds
the previous round's rendezvous keys; gloo (and NCCL) then read a dead peer's address and time out ("Gloo
connectFullMesh failed ... Connection refused"). Initialising the default process group ourselves, on that same store
but under a prefix unique to the restart round, gives every round fresh keys. accelerate and DeepSpeed then adopt
the initialised group instead of creating their own.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def init_process_group(timeout_s: int = 1800) -> None:
    """Start the default process group of a torchrun/deepspeed launch (no-op for a single process)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=not agent_store and rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    prefix = f"sft/round{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )

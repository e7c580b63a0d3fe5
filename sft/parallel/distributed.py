"""Process-group set-up that survives elastic restarts and crosses hosts (sft.parallel.nodes picks the interface).

Under `torchrun --max-restarts N`, the restarted workers of torch 2.13 reach the agent's TCPStore, which still holds
the previous round's rendezvous keys; gloo (and NCCL) then read a dead peer's address and time out ("Gloo
connectFullMesh failed ... Connection refused"). Initialising the default process group ourselves, on that same store
but under a prefix unique to the restart round, gives every round fresh keys. accelerate and DeepSpeed then adopt
the initialised group instead of creating their own.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from sft.errors import ConfigError, SFTError

# What a launcher gives each process; a process started without one (`python sft/train.py`, `sft train` without
# `--nproc-per-node`) gets the values of a one-process launch, as accelerate gives a lone process
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def lone_process_environment() -> dict[str, str]:
    """Set the variables of a one-process launch (rank 0 of 1, a free port on 127.0.0.1) when no launcher set any;
    returns what was set. Without them DeepSpeed's `init_distributed` takes the process for an MPI job and fails
    without mpi4py. A process that has some of them but not all is a launcher's, and is left as it is."""
    if any(name in os.environ for name in LAUNCH_VARIABLES):
        return {}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    values = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(port)}  # fmt: skip
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # what accelerate sets on a CPU (a thread per physical core), said once here instead of in a UserWarning each
        # time the training arguments are built (twice in a run: parsed, then planned)
        import psutil

        threads = max(psutil.cpu_count(logical=False) or 1, 1)
        torch.set_num_threads(threads)
        values["OMP_NUM_THREADS"] = str(threads)
    os.environ.update(values)
    return values


def init_process_group(timeout_s: int | None = None) -> None:
    """Start the default process group of a torchrun/deepspeed launch (no-op for a single process).

    The timeout of every collective (NCCL/gloo) is `SFT_DIST_TIMEOUT` seconds (default 1800; the launchers in
    launch/ set it from DIST_TIMEOUT): the group exists before the recipe is parsed, so it cannot come from there.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if timeout_s is None:
        timeout_s = timeout_seconds()
    from sft.parallel import nodes

    nodes.pick_interface()  # across hosts: the interface toward MASTER_ADDR, not the host name's (often loopback)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        store = dist.TCPStore(
            address,
            port,
            world_size,
            is_master=not agent_store and rank == 0,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (dist.DistStoreError, RuntimeError) as e:  # the store's client gives up after timeout_s
        raise ConfigError(
            f"Rank {rank} on {socket.gethostname()} could not reach MASTER_ADDR={address} port {port} within "
            f"{timeout_s} s ({str(e).splitlines()[0]}). Check that {address} is node 0's address as this node sees "
            "it, that node 0 has started, and that no firewall blocks the port (SFT_DIST_TIMEOUT sets the wait)."
        ) from e
    # a store shared by the agent's rounds (plain torchrun) holds every round's keys: a prefix per round. Under
    # `sft train` (sft.parallel.launch) each round has a store of its own, and no prefix: the restart count differs
    # between a node that was there and one that joined (elastic membership change), which would then never meet.
    prefix = f"sft/round{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}" if agent_store else "sft"
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


def timeout_seconds() -> int:
    """`SFT_DIST_TIMEOUT`: how long a collective (and the first connection to node 0) may wait."""
    raw = os.environ.get("SFT_DIST_TIMEOUT", "1800")
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(f"SFT_DIST_TIMEOUT must be a whole number of seconds >= 1, got {raw!r}.")
    return int(raw)


PER_RANK_FIELDS = {"local_rank", "logging_dir", "disable_tqdm"}  # disable_tqdm: sft.core.logs, by terminal


@contextlib.contextmanager
def main_first_together():
    """TRL's main-process-first (globally, then on each node) around work that checks the user's input, where an sft
    error found on one rank stops every rank with that error.

    The main process works first while the others wait in a barrier; an error that ended it there left the others in
    that barrier until gloo's "Connection closed by peer" ended them with a traceback. Here the error is held until
    every rank has had its turn, then shared (`raise_shared`), so each rank stops with the one paragraph.
    """
    from trl.trainer.utils import global_then_local_main_first

    failure = None
    with global_then_local_main_first():
        try:
            yield
        except SFTError as e:
            failure = e
    raise_shared(failure)


def raise_shared(failure: SFTError | None) -> None:
    """Every rank: if any rank has a failure, raise the first rank's (a collective: every rank must call it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if failure is None else str(failure))
    first = next((message for message in everyone if message is not None), None)
    if first is None:
        return
    raise failure if failure is not None and str(failure) == first else type(failure or SFTError)(first)


def check_ranks_agree(fingerprint: dict, *arguments) -> None:
    """Every rank must have read the same recipe, arguments, data, tokenizer and library versions.

    A node with another copy of the recipe, a different data snapshot or other library versions would otherwise
    train silently on something else; each rank raises the same error, naming the first rank and host that differs.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    import dataclasses
    import socket

    # one flat mapping: every argument field (repr, so any value compares) and the fingerprint's entries
    mine = {
        f.name: repr(getattr(args, f.name))
        for args in arguments
        for f in dataclasses.fields(args)
        if f.name not in PER_RANK_FIELDS
    }
    mine.update(fingerprint)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (socket.gethostname(), mine))
    host0, reference = everyone[0]
    for rank, (host, other) in enumerate(everyone):
        differ = [k for k in sorted(set(reference) | set(other)) if reference.get(k) != other.get(k)]
        if differ:
            details = "; ".join(f"{k}: rank 0 {reference.get(k)!r} vs rank {rank} {other.get(k)!r}" for k in differ)
            raise ConfigError(
                f"The ranks disagree: rank {rank} on {host} has a different configuration or data than rank 0 on "
                f"{host0} ({details}). Every node must run the same recipe and arguments on the same data with the "
                "same library versions; check the command and the files on that node."
            )

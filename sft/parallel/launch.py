"""`sft train --nproc-per-node N ...`: start the worker processes from the `sft` command itself.

torchrun's elastic agent used as a library, the way `accelerate launch` and `trl` do it: the same rendezvous,
environment and restarts as `torchrun --standalone --nproc_per_node N -m sft train ...` (which keeps working, as does
`torchrun sft/train.py`). What this adds is the end of a failed run:

- a configuration error (exit code 2 in the workers) is printed once, as the last line, and the command exits 2
  (3 for a step that was not finite, `sft.core.retry`)
  instead of torchrun's 1 after its ~40-line ChildFailedError report: the workers write their one-paragraph error
  into the folder in `ERROR_FILE_ENV` (one file per rank: the agent stops the other workers as soon as one exits,
  so the first to fail must be the one that wrote) instead of printing it;
- a run stopped on a signal with a complete checkpoint exits 75, like a single process;
- a run that ran out of GPU memory with sft's micro batch is run again with half of it and the same global batch,
  resuming from its newest complete checkpoint (`sft.run.failsafe`; one node);
- any other failure names the rank and exit code in one line (the worker's traceback is above it) and exits 1.

torchrun's OMP_NUM_THREADS default (1 per worker, when unset) is kept, without its banner.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import uuid
from pathlib import Path

from sft.errors import ConfigError

ERROR_FILE_ENV = "SFT_ERROR_FILE"
# sft train's launcher flags -> torchrun's; each takes a value (`--flag v` or `--flag=v`), `-` or `_` spelling
LAUNCHER_FLAGS = {
    "nproc-per-node": "--nproc-per-node",
    "nnodes": "--nnodes",
    "node-rank": "--node-rank",
    "master-addr": "--master-addr",
    "master-port": "--master-port",
    "max-restarts": "--max-restarts",
    "rdzv-endpoint": "--rdzv-endpoint",
    "rdzv-id": "--rdzv-id",
    "rdzv-timeout": "--rdzv-timeout",  # sft's: seconds the nodes wait for each other (torchrun's rdzv-conf)
}
USAGE = (
    "sft train [--nproc-per-node N [--nnodes N --node-rank R --master-addr A --master-port P | --nnodes MIN:MAX "
    "--rdzv-endpoint HOST:PORT --rdzv-id ID] [--rdzv-timeout S] [--max-restarts K]] --config RECIPE.yaml "
    "[--FIELD VALUE ...]"
)
RDZV_TIMEOUT_S = 600  # torchrun's own default for a static and a c10d rendezvous


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(torchrun's flags, the training arguments) from `sft train`'s command line."""
    launcher, rest = [], []
    i = 0
    while i < len(argv):
        flag, _, value = argv[i].partition("=")
        name = flag[2:].replace("_", "-") if flag.startswith("--") else None
        if name not in LAUNCHER_FLAGS:
            rest.append(argv[i])
            i += 1
            continue
        if not value:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"`{flag}` needs a value, e.g. {flag} 2. Usage: {USAGE}")
            value = argv[i + 1]
            i += 1
        launcher += [LAUNCHER_FLAGS[name], value]
        i += 1
    return launcher, rest


def _failed_workers(error, error_files: str, workers: int) -> int:
    """What a run whose workers failed says and exits with: the first rank's own error (written under `error_files`,
    exit 2, or the non-finite code), a stop on a signal with a checkpoint, or the failing rank and its exit code."""
    from sft.core import retry as retry_protocol
    from sft.errors import PREEMPTED_EXIT_CODE

    written = sorted(Path(error_files).glob("rank*.txt"), key=lambda p: int(p.stem[4:]))
    message = written[0].read_text().strip() if written else ""
    codes = {failure.exitcode for failure in error.failures.values()}
    if message:
        print(f"sft: error: {message}", file=sys.stderr, flush=True)
        return retry_protocol.NONFINITE_EXIT_CODE if retry_protocol.NONFINITE_EXIT_CODE in codes else 2
    if codes == {PREEMPTED_EXIT_CODE}:
        print("sft: stopped on a signal with a complete checkpoint; run the same command to continue.",
              file=sys.stderr, flush=True)  # fmt: skip
        return PREEMPTED_EXIT_CODE
    rank, failure = min(error.failures.items())
    print(f"sft: worker rank {rank} failed with exit code {failure.exitcode} (its output is above); "
          f"{len(error.failures)} of {workers} workers failed.", file=sys.stderr, flush=True)  # fmt: skip
    return 1


def launch(launcher_args: list[str], train_args: list[str]) -> int:
    """Run `sft train` in `--nproc-per-node` worker processes on this node; the exit code of the run."""
    from torch.distributed import DistError
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    from sft.core import retry as retry_protocol

    rdzv_timeout, launcher_args = _take_rdzv_timeout(launcher_args)
    args, several_nodes, endpoint = _agent_args(launcher_args, train_args, rdzv_timeout)

    # A fresh store for the workers in every rendezvous round, hosted by rank 0 (sft.parallel.distributed). torch 2.13
    # shares the agent's store between rounds instead, and writes its address for the workers only in the first round
    # node 0 takes part in: a node that joins later (elastic, NNODES=MIN:MAX) waits for it until the timeout
    # (dynamic_rendezvous.next_rendezvous keeps _bootstrap_store_info).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several workers, without its banner
    with tempfile.TemporaryDirectory(prefix="sft-launch-") as tmp:
        os.environ[ERROR_FILE_ENV] = tmp
        config, cmd, cmd_args = torchrun.config_from_args(args)
        # the agent's own failure report (a ~40-line ChildFailedError) is replaced by the lines below
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        try:
            while True:
                try:
                    elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
                    return 0
                except ChildFailedError:
                    retry = None if several_nodes else retry_protocol.retry_after_oom(tmp)
                    if retry is None:
                        raise
                    os.environ[retry_protocol.RETRY_ENV] = f"{retry.micro_cap} {retry.global_batch}"
                    print(f"sft: out of GPU memory with sft's micro batch; running again with micro batch "
                          f"{retry.micro_cap} and the global batch of {retry.global_batch} rows kept (from the newest "
                          "complete checkpoint, if any)", file=sys.stderr, flush=True)  # fmt: skip
        except ChildFailedError as e:
            return _failed_workers(e, tmp, config.nproc_per_node * config.max_nodes)
        except (RendezvousError, DistError) as e:  # nodes missing or unreachable after the rendezvous timeout
            print(f"sft: error: the rendezvous of {args.nnodes} nodes at {endpoint} failed: "
                  f"{str(e).strip().splitlines()[-1]} Check that every node was started with the same node count and "
                  f"rendezvous address, and that each one reaches {endpoint} (--rdzv-timeout, RDZV_TIMEOUT in "
                  f"launch/torchrun.sh, sets the wait: {rdzv_timeout} s).", file=sys.stderr, flush=True)  # fmt: skip
            return 1
        except SignalException as e:  # the agent passed the signal on to the workers and stopped them
            print(f"sft: stopped by {e.sigval.name}; the workers were stopped too.", file=sys.stderr, flush=True)
            return 128 + int(e.sigval)
        finally:
            os.environ.pop(ERROR_FILE_ENV, None)
            os.environ.pop(retry_protocol.RETRY_ENV, None)


def _agent_args(launcher_args: list[str], train_args: list[str], rdzv_timeout: int):
    """torchrun's arguments for the agent: (args, whether several nodes take part, the rendezvous endpoint); a node of
    several checks that it can take part before the rendezvous (`sft.parallel.nodes`)."""
    from torch.distributed import run as torchrun

    try:
        args = torchrun.get_args_parser().parse_args([*launcher_args, "--module", "sft", "train", *train_args])
    except SystemExit as e:
        raise ConfigError(f"the launcher flags {' '.join(launcher_args)} are not valid. Usage: {USAGE}") from e
    several_nodes = torchrun.parse_min_max_nnodes(args.nnodes)[1] > 1
    if args.rdzv_endpoint:
        args.rdzv_backend = "c10d"
    elif not several_nodes and "--master-port" not in launcher_args:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())  # standalone
    if args.master_port is None:
        args.master_port = 29500
    args.rdzv_conf = f"timeout={rdzv_timeout},join_timeout={rdzv_timeout}"  # static, c10d
    endpoint = args.rdzv_endpoint or f"{args.master_addr or '127.0.0.1'}:{args.master_port}"
    if several_nodes:
        from sft.parallel import nodes

        nodes.check_before_rendezvous(args.node_rank, endpoint, rdzv_timeout, static=args.rdzv_backend == "static")
        host = endpoint.rpartition(":")[0]
        if args.rdzv_backend == "c10d":  # torch decides both from the host name, which may not resolve (or not on
            # the other nodes): whether this node hosts the rendezvous store, and the address it gives the others
            args.rdzv_conf += f",is_host={nodes.is_local(host)}"
            args.local_addr = args.local_addr or nodes.route_to(host)[0]
    return args, several_nodes, endpoint


def _take_rdzv_timeout(launcher_args: list[str]) -> tuple[int, list[str]]:
    """sft's `--rdzv-timeout S` out of the launcher flags: (S, the rest)."""
    if "--rdzv-timeout" not in launcher_args:
        return RDZV_TIMEOUT_S, launcher_args
    i = launcher_args.index("--rdzv-timeout")
    value = launcher_args[i + 1]
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"`--rdzv-timeout` must be a whole number of seconds >= 1, got {value!r}.")
    return int(value), launcher_args[:i] + launcher_args[i + 2 :]


def report_error(message: str, every_rank: bool = False) -> None:
    """A worker's error: into the launcher's folder (it prints it last) or, without one, on stderr from the main
    process. Every rank writes its own file, whole or not at all (renamed into place). `every_rank`: an error one rank
    may meet alone (out of memory: another run's memory on its GPU, a rank with longer rows), printed by each rank that
    meets it, with its rank, where there is no folder; else a rank other than 0 that failed alone left no word of why
    (seen under torchrun: exit code 2 and nothing else)."""
    folder = os.environ.get(ERROR_FILE_ENV)
    rank = int(os.environ.get("RANK", "0"))
    if folder:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        partial = Path(folder) / f".rank{local}.partial"
        partial.write_text(message)
        partial.replace(Path(folder) / f"rank{local}.txt")
    elif rank == 0 or every_rank:
        who = "" if rank == 0 else f" (rank {rank})"
        print(f"sft: error{who}: {message}", file=sys.stderr, flush=True)

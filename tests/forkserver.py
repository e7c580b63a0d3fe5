"""Training runs for the tests as forks of a process that has already imported the libraries (issue #78).

A training process spends ~13.5 CPU-seconds of CI's 2 cores importing torch, transformers, TRL, PEFT, datasets and
DeepSpeed before its first step; the suite starts some 290 of them. Here one server per pytest process (a
"zygote": `python -m tests.forkserver SOCKET`) imports them once, then forks a child per run. Each child is a real
process of its own: its own environment (the launcher's RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT for a
multi-process run), working directory, stdout/stderr (the caller's file descriptors, passed over the socket) and
process id, so SIGKILL, SIGTERM, SIGUSR1 and exit codes are real; it runs `python <args>` as a fresh interpreter would
(`runpy`, as `python sft/train.py` or `python -m sft`), and leaves through the run's own exit
(`sft.core.leave`).

A run of N processes (torchrun's place) is a forked leader that forks the N workers and does what torchrun's agent
does for the tests: it waits for them, stops the others (SIGTERM, then SIGKILL after 30 s) when one fails, passes on
SIGTERM/SIGINT/SIGUSR1, and exits 0, or 1 when a worker failed, as torchrun does. Runs whose launcher is what the
test checks (torchrun's restarts and its failure report, elastic, the deepspeed launcher, SLURM, two nodes, the
README walk) start fresh interpreters instead (`tests/conftest.py`, `fresh=True`).

The standard library's `forkserver` start method is not used: it runs Python functions in the child, not a program
with its own argv, stdio and exit code, which the tests' subject (a CLI) needs.

What the zygote has imported grows: each child writes the modules it imported at exit, and the zygote imports the
new ones of the libraries below between runs, so later forks start further along. sft's own modules are never
imported there (0.1 s once the libraries are in): each child runs the code on disk now, also after an edit.
`SFT_TEST_FRESH=1` turns the whole path off (every run a fresh interpreter); `tests/multiproc/test_forked.py` proves
the two equal.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRESH_ENV = "SFT_TEST_FRESH"
# what the zygote imports before its first fork; then what its children imported, of these libraries
PRELOAD = ("torch", "torch.distributed", "transformers", "datasets", "peft", "trl", "accelerate", "deepspeed",
           "transformers.trainer", "trl.trainer.sft_trainer")  # fmt: skip
LEARN = ("torch", "transformers", "trl", "peft", "deepspeed", "datasets", "accelerate", "torchao",
         "safetensors", "tokenizers", "huggingface_hub", "wandb", "tensorboard", "pandas", "pyarrow", "scipy",
         "numpy", "jinja2", "yaml", "psutil", "bitsandbytes", "PIL", "torchvision", "lm_eval", "evaluate",
         "sklearn")  # fmt: skip
STOP_GRACE_S = 30  # torchrun's agent waits this long between SIGTERM and SIGKILL of the other workers
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def enabled() -> bool:
    return os.environ.get(FRESH_ENV) != "1"


def _die_with_parent() -> None:
    """SIGKILL this process when the one that forked or started it ends (the kernel's parent-death signal)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# ---------------------------------------------------------------------------------------------------------- client


class Forked:
    """A forked run as `subprocess.Popen` shows it: pid, poll, wait, returncode, signals. The zygote reports the exit
    status over this run's own connection; `pid` is the training process (one process) or the leader (N)."""

    def __init__(self, conn: socket.socket, args: list[str]):
        self.args, self._conn, self.returncode = args, conn, None
        self.pid = int(self._read_line(None))

    def _read_line(self, timeout: float | None) -> str | None:
        buffer = b""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not buffer.endswith(b"\n"):
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            if not select.select([self._conn], [], [], left)[0]:
                if buffer:
                    raise RuntimeError("the fork server sent a partial line")
                return None
            chunk = self._conn.recv(1)
            if not chunk:
                raise RuntimeError("the fork server closed the connection before the run's exit status")
            buffer += chunk
        return buffer.decode().strip()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._read_line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.returncode = int(line)
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.wait(0)
        return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.returncode is None:
            self.kill()
            self.wait()


class Client:
    """This pytest process's zygote, started on first use and ended with this process."""

    _lock = threading.Lock()
    _server: subprocess.Popen | None = None
    _socket: str | None = None

    @classmethod
    def address(cls, env: dict[str, str]) -> str:
        """The zygote's socket; `env` is the environment it starts (and imports) with: the tests' base one."""
        with cls._lock:
            if cls._server is None or cls._server.poll() is not None:
                folder = tempfile.mkdtemp(prefix="sft-zygote-")
                cls._socket = os.path.join(folder, "socket")
                cls._server = subprocess.Popen(
                    [sys.executable, "-m", "tests.forkserver", cls._socket], cwd=ROOT, env=env,
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(f"{folder}/log", "w"),  # noqa: SIM115
                )  # fmt: skip
            return cls._socket

    @classmethod
    def start(
        cls,
        args: list[str],
        env: dict[str, str],
        cwd: Path,
        stdout: int,
        stderr: int,
        nproc: int,
        server_env: dict[str, str],
    ) -> Forked:
        """Run `python <args>` (nproc 0) or N workers of it under a forked leader, with `env` and `cwd`, writing to
        the file descriptors `stdout` and `stderr`."""
        path = cls.address(server_env)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 300  # the first start imports the libraries
        while True:
            try:
                conn.connect(path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if cls._server.poll() is not None or time.monotonic() > deadline:
                    log = Path(path).with_name("log").read_text()[-3000:]
                    raise RuntimeError(f"the fork server did not start:\n{log}") from None
                time.sleep(0.05)
        request = json.dumps({"args": list(args), "env": env, "cwd": str(cwd), "nproc": nproc}).encode()
        socket.send_fds(conn, [len(request).to_bytes(8, "big") + request], [stdout, stderr])
        return Forked(conn, [sys.executable, *args])


def start(
    args: list[str],
    env: dict[str, str],
    cwd: Path,
    stdout: int,
    stderr: int,
    nproc: int = 0,
    server_env: dict[str, str] | None = None,
) -> Forked:
    """`python <args>` forked from this pytest process's zygote (`Client.start`)."""
    return Client.start(args, env, cwd, stdout, stderr, nproc, server_env or env)


# ---------------------------------------------------------------------------------------------------------- server


def _run_python(args: list[str]) -> None:
    """In a forked child: what `python <args>` does for a script or `-m module`, then leave with its exit code."""
    import runpy

    code = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _become(request: dict, stdout: int, stderr: int) -> None:
    """In a forked child: take the run's environment, folder and streams."""
    _die_with_parent()
    for sig in FORWARDED + (signal.SIGCHLD,):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    for fd in (devnull, stdout, stderr):
        os.close(fd)


def _fresh(modules_file: str) -> None:
    """In a forked child about to run: a fresh interpreter's thread count and random state; the modules it imported
    written at its exit, for the zygote to import before the next fork."""
    import atexit
    import random

    import numpy
    import torch

    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and int(threads) != torch.get_num_threads():
        torch.set_num_threads(int(threads))
    torch.manual_seed(torch.initial_seed())  # a fresh interpreter's default generator
    numpy.random.seed()  # from the OS, as a fresh interpreter seeds it
    random.seed()

    def write_modules() -> None:
        with contextlib.suppress(OSError), open(modules_file, "w") as f:
            json.dump(list(sys.modules), f)

    atexit.register(write_modules)  # registered first: runs after the run's own exit handlers


def _lead(request: dict, stdout: int, stderr: int, modules_dir: str) -> None:
    """In a forked child: torchrun's agent for the tests (module docstring). Forks the workers, then waits."""
    nproc = request["nproc"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _become(request, stdout, stderr)
    workers: dict[int, int] = {}
    for rank in range(nproc):
        launch = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "GROUP_RANK": 0,
                  "ROLE_RANK": rank, "ROLE_WORLD_SIZE": nproc, "GROUP_WORLD_SIZE": 1, "ROLE_NAME": "default",
                  "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": 0,
                  "TORCHELASTIC_MAX_RESTARTS": 0, "TORCHELASTIC_RUN_ID": "forked"}  # fmt: skip
        pid = os.fork()
        if pid == 0:
            _die_with_parent()
            os.environ.update({k: str(v) for k, v in launch.items()})
            _fresh(f"{modules_dir}/{os.getpid()}.json")
            _run_python(request["args"])
        workers[pid] = rank
    for sig in FORWARDED:
        signal.signal(sig, lambda sig, _frame: [_signal(pid, sig) for pid in workers])
    failed: list[tuple[int, int]] = []
    stop_at = None
    while workers:
        for pid, code in _ended():
            rank = workers.pop(pid)
            if code != 0:
                failed.append((rank, code))
                if stop_at is None:
                    [_signal(p, signal.SIGTERM) for p in workers]
                    stop_at = time.monotonic() + STOP_GRACE_S
        if stop_at is not None and time.monotonic() > stop_at:
            [_signal(p, signal.SIGKILL) for p in workers]
        time.sleep(0.05)
    for rank, code in failed:
        print(f"forked launch: rank {rank} failed with exit code {code}", file=sys.stderr, flush=True)
    os._exit(1 if failed else 0)


def _ended():
    """(pid, exit code) of each child that has ended since the last call, without waiting for the others."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no children left
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _preload(names) -> None:
    import importlib

    for name in names:
        if name in sys.modules or name.split(".")[0] not in LEARN or "__main__" in name:
            continue
        with contextlib.suppress(BaseException):
            importlib.import_module(name)


def serve(path: str) -> None:
    """The zygote: preload, then fork a child (or a leader) per request, and report each one's exit status."""
    parent = os.getppid()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # what sft sets before DeepSpeed looks, without a GPU
    _preload(PRELOAD)
    modules_dir = tempfile.mkdtemp(prefix="modules-", dir=os.path.dirname(path))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # clients connect only once it listens
    listener.listen(16)
    runs: dict[int, socket.socket] = {}
    while os.getppid() == parent:  # ends with the pytest process that started it
        if select.select([listener], [], [], 0.05)[0]:
            conn, _ = listener.accept()
            head, fds, _, _ = socket.recv_fds(conn, 8, 2, socket.MSG_WAITALL)  # the descriptors come with the head
            request = json.loads(conn.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL))
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for other in runs.values():
                    other.close()
                if request["nproc"]:
                    _lead(request, *fds, modules_dir)
                _become(request, *fds)
                _fresh(f"{modules_dir}/{os.getpid()}.json")
                _run_python(request["args"])
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            runs[pid] = conn
        for pid, code in _ended():
            conn = runs.pop(pid)
            with contextlib.suppress(OSError):
                conn.sendall(f"{code}\n".encode())
            conn.close()
        if not runs:
            for learned in Path(modules_dir).glob("*.json"):
                with contextlib.suppress(OSError, ValueError):
                    _preload(json.loads(learned.read_text()))
                learned.unlink(missing_ok=True)


if __name__ == "__main__":
    serve(sys.argv[1])

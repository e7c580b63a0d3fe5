"""Where the test suite's time goes: every Python process the suite starts, with the test that started it, its CPU
seconds and its wall seconds, summed by test module and by kind of process (issue #66: the suite's budget).

    python -m benchmarks.suite_census run --log /tmp/census -- bash .ci/run   # any command; the census rides along
    python -m benchmarks.suite_census summary --log /tmp/census --json benchmarks/results/suite_census/census.json

`run` puts a `sitecustomize` on PYTHONPATH that every Python process of the command (pytest's workers, torchrun's
agents, each training process, `sft` commands) imports at start: it appends one line to `<log>/processes.jsonl` at
exit with its command line, the test that was running when it started (pytest's `PYTEST_CURRENT_TEST`, which child
processes inherit), and its own user + system CPU seconds. A process killed by a signal (the suite's SIGKILL tests)
writes no line; its count shows as `started - ended`. A child forked from a process (the tests' fork server,
tests/forkserver.py) writes its own line, with its own CPU seconds, its argv and the test in its environment; a
forked child killed by a signal is not counted at all. The hook imports only the standard library and writes nothing
to the console, so the suite runs as it would without it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

HOOK = r"""
import os
if os.environ.get("SFT_CENSUS_LOG"):
    import atexit, json, time
    _started, _test = time.time(), os.environ.get("PYTEST_CURRENT_TEST", "")
    try:
        with open("/proc/self/cmdline", "rb") as f:
            _cmd = [a.decode(errors="replace") for a in f.read().split(b"\0") if a][:12]
    except OSError:
        _cmd = []
    _log = os.path.join(os.environ["SFT_CENSUS_LOG"], "processes.jsonl")
    with open(os.path.join(os.environ["SFT_CENSUS_LOG"], "started.jsonl"), "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "test": _test}) + "\n")

    _pid = os.getpid()

    def _forked():  # a child forked from this process (the tests' fork server): its own clock from here
        global _started
        _started = time.time()

    os.register_at_fork(after_in_child=_forked)

    def _census():
        import sys

        t, forked = os.times(), os.getpid() != _pid
        cmd = ["(forked)", sys.executable, *sys.argv][:12] if forked else _cmd  # the child's argv, set after the fork
        test = os.environ.get("PYTEST_CURRENT_TEST", "") if forked else _test
        line = {"pid": os.getpid(), "test": test, "cmd": cmd, "cpu": round(t.user + t.system, 2),
                "wall": round(time.time() - _started, 2), "forked": forked}
        with open(_log, "a") as f:
            f.write(json.dumps(line) + "\n")

    atexit.register(_census)
"""


def kind(cmd: list[str]) -> str:
    """What a process was, from its command line."""
    head, text = " ".join(cmd[:5]), " ".join(cmd)
    if "tests.forkserver" in head:
        return "fork server (imports once per pytest process)"
    if cmd[:1] == ["(forked)"]:
        return "forked training process" if any(a.endswith("sft/train.py") for a in cmd) else "forked other"
    if "torch.distributed.run" in head or "torchrun" in head or "--nproc-per-node" in text:
        return "launcher agent"
    if any(a.endswith("sft/train.py") for a in cmd) or "sft train" in head:  # also `-m sft train`: the agent's workers
        return "training process"
    if "-m pytest" in head or "exec(eval(sys.stdin" in text:  # pytest and its xdist workers (execnet)
        return "pytest (the tests in-process)"
    if "deepspeed" in head:
        return "deepspeed launcher"
    if "lm_eval" in head or "eval" in head:
        return "evaluation"
    return "other (sft commands, probes, pip)"


def module_of(test: str) -> str:
    return test.split("::")[0] if test else "(outside a test)"


def summary(log: Path) -> dict:
    ended = [json.loads(line) for line in (log / "processes.jsonl").read_text().splitlines()]
    started = [json.loads(line) for line in (log / "started.jsonl").read_text().splitlines()]
    by_module: dict = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0, "killed": 0})
    by_kind: dict = collections.defaultdict(lambda: {"processes": 0, "cpu_s": 0.0})
    for p in ended:
        if kind(p["cmd"]).startswith("pytest"):
            continue  # the workers' own time is pytest's --durations
        m, k = by_module[module_of(p["test"])], by_kind[kind(p["cmd"])]
        m["processes"] += 1
        m["cpu_s"] += p["cpu"]
        k["processes"] += 1
        k["cpu_s"] += p["cpu"]
    done = {p["pid"] for p in ended}
    for p in started:
        if p["pid"] not in done:
            by_module[module_of(p["test"])]["killed"] += 1
    rounded = {name: {k: round(v, 1) for k, v in row.items()} for name, row in by_module.items()}
    return {
        "processes_ended": len(ended),
        "processes_without_an_end (killed)": len(started) - sum(not p.get("forked") for p in ended),
        "forked_processes_ended": sum(bool(p.get("forked")) for p in ended),
        "cpu_s_of_processes_ended": round(sum(p["cpu"] for p in ended), 1),
        "by_module": dict(sorted(rounded.items(), key=lambda kv: -kv[1]["cpu_s"])),
        "by_kind": {name: {k: round(v, 1) for k, v in row.items()} for name, row in by_kind.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.suite_census", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["run", "summary"])
    parser.add_argument("--log", type=Path, required=True, help="the folder the census writes (run) or reads")
    parser.add_argument("--json", type=Path, help="summary: also write it to this file")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, command = parser.parse_args(argv[:split]), argv[split + 1 :]  # run: the command after --
    if args.action == "run":
        args.log.mkdir(parents=True, exist_ok=True)
        hook = args.log / "hook"
        hook.mkdir(exist_ok=True)
        (hook / "sitecustomize.py").write_text(HOOK)
        path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONPATH": path, "SFT_CENSUS_LOG": str(args.log.resolve())}
        if not command:
            parser.error("run: give the command after --")
        return subprocess.run(command, env=env).returncode
    result = summary(args.log)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

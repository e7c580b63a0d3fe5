"""Two nodes on one machine, for real: two Linux network namespaces joined by one veth pair, each "node" with its own
interface, address and host name (its own UTS namespace), nothing else reachable from them (no default route, the
machine's own namespace untouched). Needs root and iproute2; skipped with the reason otherwise. The namespaces and
every process in them are removed at the end, also when a test fails.

`hosts` gives two `Node`s; `sshd` starts an ssh server in each with a key made for the test (DeepSpeed's launcher
reaches the hosts over ssh through pdsh), and a `bin` folder whose `ssh` uses that key and configuration only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@dataclass
class Node:
    name: str  # its host name
    netns: str
    interface: str
    address: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this node: in its network namespace, under its own host name."""
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *argv]  # fmt: skip

    def start(self, argv: list[str], log: Path, env: dict, cwd: Path | str) -> subprocess.Popen:
        out = open(log, "a")  # noqa: SIM115 (the process writes to it until it ends)
        return subprocess.Popen(self.command(argv), cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)

    def pids(self) -> list[int]:
        found = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30)
        return [int(p) for p in found.stdout.split()]

    def kill_all(self) -> int:
        """SIGKILL every process of this node, as if the machine had died; how many there were."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        return len(pids)


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces (run the tests as root)"
    for tool in ("ip", "unshare"):
        if not shutil.which(tool):
            return f"needs `{tool}` (iproute2 / util-linux)"
    probe = f"sftprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _sweep_left_over() -> None:
    """Namespaces of an earlier test session that was killed (SIGKILL skips the fixture's own clean-up), named
    after its process id: their processes killed and the namespaces deleted once that process is gone."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for name in re.findall(r"^sft-(\d+)-n[01]\b", listed, flags=re.M):
        if not Path(f"/proc/{name}").exists():
            for netns in (f"sft-{name}-n0", f"sft-{name}-n1"):
                Node("", netns, "", "").kill_all()
                subprocess.run(["ip", "netns", "del", netns], capture_output=True)


@pytest.fixture(scope="session")
def hosts():
    reason = _unavailable()
    if reason:
        pytest.skip(f"several-node tests skipped: {reason}")
    _sweep_left_over()
    pid = os.getpid()
    tag = pid % 10000
    subnet = f"10.{200 + tag % 50}.{tag % 250}"
    nodes = [Node(f"node{i}", f"sft-{pid}-n{i}", f"sft{tag}v{i}", f"{subnet}.{i + 1}") for i in (0, 1)]
    try:
        for node in nodes:
            _ip("netns", "add", node.netns)
        _ip("link", "add", nodes[0].interface, "type", "veth", "peer", "name", nodes[1].interface)
        for node in nodes:
            _ip("link", "set", node.interface, "netns", node.netns)
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.interface)
            _ip("-n", node.netns, "link", "set", node.interface, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for node in nodes:
            node.kill_all()
        time.sleep(0.5)
        for node in nodes:
            subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)  # takes its end of the veth


@pytest.fixture(scope="session")
def sshd(hosts, tmp_path_factory):
    """An ssh server on each node (port 22 of its address), root login by a key made here; returns the folder of
    an `ssh` that uses only that key and a configuration of its own (the user's ~/.ssh is not read or changed)."""
    for tool in ("sshd", "ssh", "ssh-keygen", "pdsh"):
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists():
            pytest.skip(f"the ssh launcher test needs {tool}: apt-get install openssh-server openssh-client pdsh")
    d = tmp_path_factory.mktemp("ssh")
    for key in ("client", "host"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / key)], check=True, timeout=60)
    (d / "authorized_keys").write_text((d / "client.pub").read_text())
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory (its package makes it at boot)
    servers = []
    for node in hosts:
        config = d / f"sshd_{node.name}"
        config.write_text(
            f"ListenAddress {node.address}\nHostKey {d / 'host'}\nAuthorizedKeysFile {d / 'authorized_keys'}\n"
            f"PidFile {d / node.name}.pid\nPermitRootLogin prohibit-password\nPasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
        )
        servers.append(node.start(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], d / f"{node.name}.log",
                                  env=dict(os.environ), cwd=d))  # fmt: skip
    (d / "ssh_config").write_text(
        f"Host *\n  IdentityFile {d / 'client'}\n  IdentitiesOnly yes\n  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 10\n"
    )
    bin_dir = d / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {d / "ssh_config"} "$@"\n')
    (bin_dir / "ssh").chmod(0o755)
    deadline = time.time() + 30
    for node in hosts:  # each server answers before the test starts
        while True:
            probe = subprocess.run(hosts[0].command([str(bin_dir / "ssh"), node.address, "hostname"]),
                                   capture_output=True, text=True, timeout=30)  # fmt: skip
            if probe.returncode == 0 and probe.stdout.strip() == node.name:
                break
            assert time.time() < deadline, f"sshd on {node.name}: {probe.stderr}{(d / f'{node.name}.log').read_text()}"
            time.sleep(0.3)
    yield bin_dir
    for server in servers:
        server.kill()

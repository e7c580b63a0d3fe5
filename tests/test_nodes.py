"""sft.parallel.nodes in-process, on this host's own interfaces (the two-host runs: tests/multinode/)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from sft.errors import ConfigError
from sft.parallel import nodes


def test_the_route_to_loopback_is_lo_and_a_single_host_sets_no_interface(monkeypatch):
    assert nodes.route_to("127.0.0.1") == ("127.0.0.1", "lo")
    for variable in nodes.INTERFACE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert nodes.pick_interface() is None
    assert all(variable not in os.environ for variable in nodes.INTERFACE_VARIABLES)
    assert nodes.is_local("localhost") and nodes.is_local("127.0.0.1")


def test_an_interface_named_that_this_host_lacks_is_refused_with_the_ones_it_has(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9x")
    with pytest.raises(ConfigError) as e:
        nodes.pick_interface()
    assert str(e.value).startswith("GLOO_SOCKET_IFNAME=eth9x names an interface this node") and "lo 127.0.0.1" in str(
        e.value
    )
    # NCCL's spelling: prefixes, `=` for exact names, `^` to exclude
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    for named, ok in [("l", True), ("=l", False), ("=lo", True), ("^lo", True), ("lo,zz", False)]:
        monkeypatch.setenv("NCCL_SOCKET_IFNAME", named)
        if ok:
            nodes.pick_interface()
        else:
            with pytest.raises(ConfigError, match=f"NCCL_SOCKET_IFNAME={named} names"):
                nodes.pick_interface()


def test_the_checks_before_the_rendezvous(monkeypatch):
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        nodes.check_before_rendezvous(1, "node0", 5, static=True)
    with pytest.raises(ConfigError, match="does not resolve on this node"):
        nodes.check_before_rendezvous(1, "no-such-host.invalid:29500", 5, static=True)
    with socket.socket() as server:  # an address of this host that listens: node 1 gets through at once
        server.bind(("127.0.0.1", 0))
        server.listen()
        nodes.check_before_rendezvous(0, f"127.0.0.1:{server.getsockname()[1]}", 5, static=True)
    # nobody listens on port 9 of 127.0.0.2 (taken as another host here): the wait ends at the timeout, naming it
    monkeypatch.setattr(nodes, "is_local", lambda host: False)
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        nodes.check_before_rendezvous(1, "127.0.0.2:9", 2, static=True)
    assert time.monotonic() - started < 10
    assert "could not reach the rendezvous at 127.0.0.2 port 9 within 2 s" in str(e.value)


def test_a_worker_that_cannot_reach_master_addr_says_so_within_the_timeout(monkeypatch):
    """Under DeepSpeed's launcher (no agent, no check before): the worker's own first connection to MASTER_ADDR."""
    from sft.parallel.distributed import init_process_group

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    started = time.monotonic()
    with pytest.raises(ConfigError) as e:
        init_process_group(timeout_s=2)
    assert time.monotonic() - started < 30
    expected = f"Rank 1 on {socket.gethostname()} could not reach MASTER_ADDR=127.0.0.1 port {port} within 2 s"
    assert str(e.value).startswith(expected), str(e.value)

"""Several nodes: the interface this node talks to the others on, reaching node 0, and the table of nodes.

On one host every process meets on the loopback address. Across hosts, gloo and NCCL pick their interface from the
host name, which on many clusters (and in any container or network namespace without its name in /etc/hosts)
resolves to nothing or to the loopback address: gloo then falls back to 127.0.0.1 and the other node's connection is
refused ("Gloo connectFullMesh failed"). sft instead takes the interface the kernel routes toward MASTER_ADDR, the
one address every node must reach anyway, unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are set.

- `route_to(host)`: (this node's address, interface) toward a host;
- `pick_interface()`: in a worker, before its process group: sets the collective backend's interface variables;
- `check_before_rendezvous(...)`: in the launcher (`sft train --nnodes ...`, launch/torchrun.sh): fails with a
  message naming the address and what to check, where the rendezvous would hang or fail deep inside torch;
- `log_table()`: at the start of a run, one line per node: host name, address, interface, ranks, timeout.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time

from sft.errors import ConfigError

logger = logging.getLogger("sft")
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _addresses(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)})
    except socket.gaierror as e:
        raise ConfigError(
            f"The address {host!r} does not resolve on this node ({socket.gethostname()}): {e.strerror}. "
            "Give node 0's IP address, or a name every node resolves (check /etc/hosts or DNS on this node)."
        ) from e


def _interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4/IPv6 addresses, for the interfaces of this host (network namespace)."""
    import psutil

    return {
        name: [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        for name, addrs in psutil.net_if_addrs().items()
    }


def route_to(host: str) -> tuple[str, str]:
    """(this node's address, its interface) that traffic toward `host` leaves from."""
    address = _addresses(host)[0]
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:  # connect() on UDP sends nothing: it only routes
        try:
            probe.connect((address, 9))
        except OSError as e:
            raise ConfigError(
                f"No route from this node ({socket.gethostname()}) to {host} ({address}): {e.strerror}. Check that "
                f"{host} is node 0's address as this node sees it, and this node's interfaces ({interfaces_line()})."
            ) from e
        local = probe.getsockname()[0]
    for name, addrs in _interfaces().items():
        if local in addrs:
            return local, name
    return local, "?"


def interfaces_line() -> str:
    return ", ".join(f"{name} {' '.join(addrs) or '-'}" for name, addrs in sorted(_interfaces().items()))


def is_local(host: str) -> bool:
    """Whether `host` is an address (or a name of an address) of this node."""
    mine = {a for addrs in _interfaces().values() for a in addrs}
    return any(a in mine or ipaddress.ip_address(a).is_loopback for a in _addresses(host))


def pick_interface() -> str | None:
    """In a worker of a run whose MASTER_ADDR is not a loopback address: the interface toward it, written to
    GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME where unset; an interface named there must exist. The one used, or
    None on a single host."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    interfaces = _interfaces()
    for variable in INTERFACE_VARIABLES:
        named = os.environ.get(variable, "")
        if named and not _names_exist(variable, named, interfaces):
            raise ConfigError(
                f"{variable}={named} names an interface this node ({socket.gethostname()}) does not have. Its "
                f"interfaces: {interfaces_line()}. Unset {variable} (sft then takes the interface toward "
                f"MASTER_ADDR={master}) or name one of these."
            )
    if all(ipaddress.ip_address(a).is_loopback for a in _addresses(master)):
        return None
    _, interface = route_to(master)
    if interface != "?":  # an address no interface lists: the backends keep their own choice
        for variable in INTERFACE_VARIABLES:
            os.environ.setdefault(variable, interface)
    return os.environ.get(_backend_variable(), interface)


def _names_exist(variable: str, named: str, interfaces: dict) -> bool:
    """GLOO_SOCKET_IFNAME: exact names, comma-separated; NCCL_SOCKET_IFNAME: prefixes, `=` for exact names, `^` to
    exclude (not checked)."""
    if variable == "GLOO_SOCKET_IFNAME":
        return all(name in interfaces for name in named.split(",") if name)
    if named.startswith("^"):
        return True
    exact, names = named.startswith("="), named.lstrip("=").split(",")
    return all(any(i == n if exact else i.startswith(n) for i in interfaces) for n in names if n)


def _backend_variable() -> str:
    import torch

    return "NCCL_SOCKET_IFNAME" if torch.cuda.is_available() else "GLOO_SOCKET_IFNAME"


def check_before_rendezvous(node_rank: int | None, endpoint: str, timeout_s: float, static: bool) -> None:
    """Before this node's agent joins the rendezvous at `endpoint` (host:port): under a static rendezvous node 0
    hosts it, so its address must be one of node 0's; every other node waits (up to `timeout_s`) until it can
    open a connection to it, instead of torch's agent retrying silently or failing with a traceback."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"The rendezvous address {endpoint!r} is not HOST:PORT (e.g. 10.0.0.1:29500).")
    here = socket.gethostname()
    if static and node_rank == 0:
        if not is_local(host):
            raise ConfigError(
                f"MASTER_ADDR={host} is not an address of this node ({here}, node rank 0), which hosts the "
                f"rendezvous. Its interfaces: {interfaces_line()}. Set MASTER_ADDR to one of these addresses, the "
                "one the other nodes reach this node at."
            )
        return
    if is_local(host):
        return
    local, interface = route_to(host)
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            last = e.strerror or type(e).__name__
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"This node ({here}, {local} on {interface}) could not reach the rendezvous at {host} port {port} "
                f"within {timeout_s:.0f} s ({last}). Check that node 0 has started with the same NNODES, that "
                f"{host} is its address as this node sees it, and that no firewall between the nodes blocks port "
                f"{port}; RDZV_TIMEOUT sets how long to wait."
            )
        time.sleep(1.0)


def log_table(timeout_s: int) -> None:
    """One line per node, from the main process: host name, address and interface toward node 0, its ranks, the
    collective timeout it runs with. Every rank takes part (one all_gather)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    address, interface = route_to(master)
    mine = (socket.gethostname(), address, os.environ.get(_backend_variable()) or interface, timeout_s)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return
    nodes: dict[tuple, list[int]] = {}
    for rank, info in enumerate(everyone):
        nodes.setdefault(info, []).append(rank)
    if len(nodes) == 1 and ipaddress.ip_address(address).is_loopback:
        return  # one host on loopback: nothing to tell
    logger.info("Nodes: %d (%s, rendezvous at %s)", len(nodes), dist.get_backend(), master)
    for (host, addr, iface, timeout), ranks in nodes.items():
        ranks_text = ",".join(map(str, ranks))
        logger.info("  %s  %s via %s  ranks %s  collective timeout %d s", host, addr, iface, ranks_text, timeout)

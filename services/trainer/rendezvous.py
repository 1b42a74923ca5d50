"""Where the data-parallel group meets: the c10d TCPStore that rank 0 hosts and every other rank joins.

Resolution order (`store_address`):
    1. `trainer.rendezvous` ("host:port"), from the config;
    2. torchrun's environment, MASTER_ADDR and MASTER_PORT (both set);
    3. 127.0.0.1 and a free port chosen by the OS (embedded runs: workers are local processes).
Rank 0 hosts the store (it listens on every interface of its host at that port); each worker
connects to host:port, so a worker may run on another host once that address is routable from it.
Each rank's gloo transport binds the interface named by GLOO_SOCKET_IFNAME when set (torch's own
variable; needed where the store's host name is not an address of that rank's host), else the
store's host.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

LOCAL_HOST = "127.0.0.1"


def store_address(configured: str | None, env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """(host, port) of the group's store; port 0 = any free port (only with the local default)."""
    env = os.environ if env is None else env
    if configured:
        host, _, port = configured.rpartition(":")
        return host.strip("[]"), int(port)
    if env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        return env["MASTER_ADDR"], int(env["MASTER_PORT"])
    return LOCAL_HOST, 0


def host_store(host: str, port: int, timeout_s: float) -> Any:
    """The store rank 0 hosts (does not wait for workers); `.port` is the port actually bound."""
    return dist.TCPStore(
        host, port, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def join_store(host: str, port: int, timeout_s: float) -> Any:
    """A worker's client of rank 0's store (blocks until it connects or `timeout_s` passes)."""
    return dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=timeout_s))


def gloo_device(host: str) -> Any:
    """The gloo transport device of this rank: GLOO_SOCKET_IFNAME's interface, else `host`'s."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_device(hostname=host)

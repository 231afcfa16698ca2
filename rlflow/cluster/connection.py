"""Reaching a Ray cluster, and the measurement slot that keeps two timings off one machine.

Timings must never share a machine's cores, so every task that measures asks for the custom resource
`MEASUREMENT_SLOT`, of which each node offers one (`ray start ... --resources '{"rlflow_measurement": 1}'`); a local
cluster started here gets it.
"""
from __future__ import annotations

import contextlib
import platform
from typing import Iterator

from rlflow.errors import RlflowError

MEASUREMENT_SLOT = "rlflow_measurement"
"""The custom resource a node offers once, so that no two measuring tasks run on one machine at a time."""

RETRIES = 1
"""Times a task is retried after its worker or its node died."""


def import_ray():
    """The ray module.

    Raises:
        RlflowError: Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise RlflowError("--ray needs Ray: pip install 'rlflow[ray]'") from None
    return ray


@contextlib.contextmanager
def connected(address: str) -> Iterator:
    """Ray, connected to the cluster at `address` (`local`: a new one started here, whatever else runs on this
    machine) for the duration, unless this process is connected already; checks that some node offers the slot.

    Raises:
        RlflowError: Ray is missing, the cluster cannot be reached, or no node offers a measurement slot.
    """
    ray = import_ray()
    started_here = not ray.is_initialized()
    if started_here:
        _connect(ray, address)
    try:
        if not ray.cluster_resources().get(MEASUREMENT_SLOT):
            raise RlflowError(f"no node of the Ray cluster offers a measurement slot: start each node with "
                              f"ray start ... --resources '{{\"{MEASUREMENT_SLOT}\": 1}}'")
        yield ray
    finally:
        if started_here:
            ray.shutdown()


REACH_TIMEOUT_S = 5.0
"""Seconds to wait for a cluster's address to answer before saying it cannot be reached (Ray itself retries for
minutes on an address where nothing listens)."""


def _reachable(address: str) -> str | None:
    """Why nothing answers at `address` (`host:port` or `ray://host:port`), or None when something does or the address
    is not of that form (`auto`: Ray finds the cluster itself, and says so at once when there is none)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _connect(ray, address: str) -> None:
    if address != "local" and (why := _reachable(address)) is not None:
        raise RlflowError(f"cannot reach the Ray cluster at '{address}': {why}")
    try:
        if address == "local":  # "local" starts a new instance even where another cluster runs or once ran
            ray.init(address="local", resources={MEASUREMENT_SLOT: 1}, include_dashboard=False, log_to_driver=False,
                     configure_logging=False)
        else:
            ray.init(address=address, log_to_driver=False, configure_logging=False)
    except Exception as exc:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError and its own types
        raise RlflowError(f"cannot reach the Ray cluster at '{address}': {str(exc).splitlines()[0][:200]}") from None


def node_label() -> str:
    """This process's machine as rows and reports name it: host name and the Ray node's id (simulated nodes share a
    host name)."""
    ray = import_ray()
    node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    return f"{platform.node()}/{node[:8]}" if node else platform.node()


def measuring_nodes(ray) -> list[str]:
    """Ids of the live nodes that offer a measurement slot."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(MEASUREMENT_SLOT))

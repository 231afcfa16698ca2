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


def _connect(ray, address: str) -> None:
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

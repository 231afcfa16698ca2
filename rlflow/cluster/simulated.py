"""A Ray cluster of several nodes on one machine, each node with its own rlflow cache, for trying `--ray` without a
cluster (`rlflow simulate-cluster`) and for the tests.

Each node's processes see their own `RLFLOW_CACHE` (set when the node starts), so cost tables and zoo builds never
pass through a shared folder: what a node needs comes through Ray, as on machines without a shared disk.  The head
node offers no measurement slot, so tasks run on the other nodes only, and the objects the driver puts (on the head)
survive a node's removal.  The nodes share this machine's cores: timings taken on them are not a cluster's.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from rlflow.cluster.connection import MEASUREMENT_SLOT, import_ray


@dataclass
class SimulatedCluster:
    """The running cluster: its address, the Ray `Cluster` handle and its measuring nodes (with their caches)."""

    address: str
    cluster: object
    root: Path
    cpus_per_node: int = 1
    nodes: list = field(default_factory=list)
    caches: list[Path] = field(default_factory=list)

    def add_node(self):
        """One more measuring node, with a cache of its own (`root/node<i>`); returns its handle."""
        self.caches.append(self.root / f"node{len(self.caches)}")
        before = os.environ.get("RLFLOW_CACHE")
        os.environ["RLFLOW_CACHE"] = str(self.caches[-1])  # the node's processes inherit it
        try:
            node = self.cluster.add_node(num_cpus=self.cpus_per_node, resources={MEASUREMENT_SLOT: 1})
        finally:
            _restore(before)
        self.nodes.append(node)
        self.cluster.wait_for_nodes()
        return node

    def node_of(self, node_id: str):
        """The node handle whose Ray id is `node_id` (to remove it)."""
        return next(n for n in self.nodes if n.node_id == node_id)

    def remove(self, node) -> None:
        self.cluster.remove_node(node)
        self.nodes.remove(node)


@contextlib.contextmanager
def simulated_cluster(nodes: int, root: str | os.PathLike, cpus_per_node: int = 1) -> Iterator[SimulatedCluster]:
    """`nodes` measuring nodes (one slot each, cache `root/node<i>`) and a head node without a slot; stopped after."""
    import_ray()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        simulated = SimulatedCluster(cluster.address, cluster, Path(root), cpus_per_node)
        for _ in range(nodes):
            simulated.add_node()
        yield simulated
    finally:
        cluster.shutdown()


def _restore(value: str | None) -> None:
    if value is None:
        os.environ.pop("RLFLOW_CACHE", None)
    else:
        os.environ["RLFLOW_CACHE"] = value


def serve(nodes: int = 3, root: str | os.PathLike | None = None, address_file: str | os.PathLike | None = None,
          seconds: float = 0.0, remove_node_after: float | None = None) -> None:
    """`rlflow simulate-cluster`: a simulated cluster of `nodes` measuring nodes (caches under `root`, default a new
    temporary folder) that stays up until Ctrl-C (or `seconds`), its address printed (and written to `address_file`)
    for `rlflow bench --ray ADDRESS` and `rlflow train ... --ray ADDRESS` from another shell; `remove_node_after`
    seconds after the start one measuring node goes, as a machine lost mid-run."""
    import tempfile
    import time

    if nodes < 1:
        raise ValueError("nodes must be at least 1")
    root = Path(root) if root else Path(tempfile.mkdtemp(prefix="rlflow-cluster-"))
    with simulated_cluster(nodes, root) as cluster:
        print(f"a simulated Ray cluster of {nodes} measuring nodes at {cluster.address} (node caches under "
              f"{root}); try: rlflow bench MODELS --ray {cluster.address}", flush=True)
        if address_file:
            from rlflow.files import write_text_atomic

            write_text_atomic(address_file, cluster.address + "\n")
        start = time.monotonic()
        try:
            while not seconds or time.monotonic() - start < seconds:
                if remove_node_after is not None and time.monotonic() - start >= remove_node_after:
                    node = cluster.nodes[-1]
                    cluster.remove(node)
                    print(f"removed node {node.node_id[:8]} after {time.monotonic() - start:.0f} s", flush=True)
                    remove_node_after = None
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass

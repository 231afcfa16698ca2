"""`rlflow simulate-cluster`: a Ray cluster of several nodes on this machine, for trying `--ray` without one."""
from __future__ import annotations

import click


@click.command("simulate-cluster")
@click.option("--nodes", type=click.IntRange(min=1), default=3, show_default=True,
              help="Measuring nodes, one slot each.")
@click.option("--root", default=None,
              help="Folder of the nodes' caches, root/node<i> [default: a new temporary folder].")
@click.option("--address-file", default=None, help="Write the cluster's address here once it is up.")
@click.option("--seconds", type=float, default=0.0, help="Stop after this long [default: at Ctrl-C].")
@click.option("--remove-node-after", type=float, default=None, metavar="SECONDS",
              help="Remove one measuring node this long after start, as a machine lost mid-run.")
def simulate_cluster(nodes, root, address_file, seconds, remove_node_after) -> None:
    """A Ray cluster of several nodes on this machine, each with its own cache, for trying --ray.

    Prints its address (and writes it to --address-file) for `rlflow bench --ray ADDRESS` and `rlflow train ...
    --ray ADDRESS` from another shell, and stays up until Ctrl-C or --seconds."""
    from rlflow.cluster.simulated import serve

    serve(nodes, root, address_file, seconds, remove_node_after)

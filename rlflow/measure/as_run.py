"""What onnxruntime runs of a model: its graph after onnxruntime's own optimisations at session creation.

Two rewritten graphs that differ only by what onnxruntime removes or folds anyway (a Cast to the type a tensor has, a
Reshape to the shape it has, a shape computation folded to a constant) run the very same kernels: measuring both is
measuring one model twice, and their figures part by noise alone.  The bench measures such outputs once
(`rlflow.bench.method_rows`).  In four cases where greedy's output measured 1.2-5.7% ahead of the agent's on the
held-out exports, greedy's one extra step was such a rewrite.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import replace

import onnx
import onnx_graphsurgeon as gs

from rlflow.graph.core import Graph
from rlflow.graph.fingerprint import fingerprint
from rlflow.measure.profile_comparison import export_at
from rlflow.measure.session import SessionSettings, create_session

log = logging.getLogger("rlflow")

WEIGHTS_FILE = "weights.bin"
"""Where the saved optimised model keeps its weights (beside it, in the temporary folder): a model over protobuf's
2 GB limit saves too."""


def fingerprint_as_run(graph: Graph, settings: SessionSettings) -> str | None:
    """A structural fingerprint (`rlflow.graph.fingerprint`) of `graph` as onnxruntime runs it with `settings`
    (provider and optimisation level) at each shape it is measured at (its profiles), or None where onnxruntime
    cannot build or save it (its own fingerprint then tells it apart from others)."""
    prints = []
    for profile in list(graph.profiles) or [None]:
        with tempfile.TemporaryDirectory(prefix="rlflow-as-run-") as folder:
            path = os.path.join(folder, "optimised.onnx")
            try:
                create_session(export_at(graph, profile), replace(settings, cuda_graph=False), save_optimised=path,
                               weights_file=WEIGHTS_FILE)
                saved = onnx.load(path)  # its weights from WEIGHTS_FILE, beside it
            except Exception as exc:  # noqa: BLE001 - onnxruntime raises several private exception types
                log.debug("onnxruntime's optimised graph could not be saved (%s): the graph itself tells it apart", exc)
                return None
        prints.append(fingerprint(gs.import_onnx(saved)))
    return "+".join(prints)


__all__ = ["fingerprint_as_run"]

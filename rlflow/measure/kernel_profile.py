"""Per-node kernel times from onnxruntime's profiler: where a model spends its time."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx

from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings, create_session, ort_feeds


@dataclass
class NodeTime:
    """Mean kernel time of one node (as onnxruntime names it after its own fusions)."""

    node: str
    op: str
    provider: str
    mean_us: float
    calls: int


def profile_nodes(model: onnx.ModelProto, settings: SessionSettings | None = None, *, runs: int = 10,
                  seed: int = 0) -> list[NodeTime]:
    """Runs the model `runs` times under the profiler (the first run is discarded) and returns node times, slowest first."""
    settings = settings or SessionSettings()
    with tempfile.TemporaryDirectory(prefix="rlflow-profile-") as tmp:
        session = create_session(model, settings, profile_prefix=os.path.join(tmp, "profile"))
        feeds = ort_feeds(random_inputs(model, seed))
        names = [o.name for o in session.get_outputs()]
        for _ in range(runs + 1):
            session.run_with_ort_values(names, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    first_run = {}
    totals: dict[str, list] = {}
    for event in events:
        if event.get("cat") != "Node" or not event.get("name", "").endswith("_kernel_time"):
            continue
        node = event["name"][: -len("_kernel_time")]
        if node not in first_run:  # drop each node's first call: allocation and algorithm choice
            first_run[node] = True
            continue
        args = event.get("args", {})
        entry = totals.setdefault(node, [args.get("op_name", "?"), args.get("provider", "?"), 0.0, 0])
        entry[2] += float(event.get("dur", 0))
        entry[3] += 1
    result = [NodeTime(node, op, provider, total / calls, calls) for node, (op, provider, total, calls) in totals.items()]
    return sorted(result, key=lambda n: -n.mean_us)

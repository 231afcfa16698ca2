"""Timing an isolated fusion group (`rlflow.measure.costmodel.groups.isolated_model`): its seconds beyond the per-call overhead.

A cost table entry is a group's time beyond the call overhead, not its time: Python's per-call cost is paid once per
graph, not once per group.  So the fastest of several batched runs of the group is taken minus that of a trivial
session with as many inputs and outputs (`probe_model`), timed in batches alternating with the group's own every time
a group is measured (`time_beyond`): the difference is a few microseconds on small groups, so an overhead timed once
and reused would turn one busy moment into a bias on every group measured after it.  A small group is timed as up to
`MAX_REPLICAS` copies side by side in one model (`replicas`, `replicated`), so that its microseconds rise above the
noise of the call overhead, and each difference is scaled by the machine's slowdown at the time, read from a
reference model timed beside it (`Gauge`).  `reorder_probe` times the NCHWc reorders onnxruntime adds at the edges
of an isolated group, which the cost model subtracts (inside the whole graph, NCHWc convolutions pass blocked tensors
to each other without them).
"""
from __future__ import annotations

import math
import time

import numpy as np
import onnx
from onnx import helper

from rlflow.graph.model_file import max_ir_version
from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings

CALIBRATION_S = 0.3
"""Seconds a process times the slowdown gauge's reference before its first measurement (see `Gauge`)."""

SESSION_PAIRS = 3
"""Independently built (group, probe) session pairs per table entry; the median of their differences counts."""

REPLICA_TARGET_S = 1e-3
"""A group that runs faster than this (with the call overhead) is timed as several copies in one model."""

MAX_REPLICAS = 32
"""Most copies of one group timed together (bounds the model built for a microsecond-sized group)."""

MAX_REPLICA_BYTES = 64 << 20
"""Most bytes of weights a replicated model holds: a fast group that reads a large table is timed with fewer copies
(one at least).  BERT's word embedding (a Gather from 47 MB) as 32 copies made a 1.5 GB model whose sessions took 35 s
to build, most of a cold table's filling on BERT L6/H384."""


def replicas(model: onnx.ModelProto, settings: SessionSettings) -> int:
    """How many copies of an isolated group make one run last about `REPLICA_TARGET_S` (1 to `MAX_REPLICAS`)."""
    from rlflow.measure.timing import Runner

    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for node in model.graph.node for a in node.attribute):
        return 1  # a subgraph may name outer tensors, which the copies rename
    most = MAX_REPLICA_BYTES // max(weight_bytes(model), 1)
    if most <= 1:
        return 1
    runner = Runner(model, settings, random_inputs(model, 0))
    for _ in range(2):
        runner.run()
    once = min(runner.time(1) for _ in range(3))
    return int(min(MAX_REPLICAS, most, max(1, math.ceil(REPLICA_TARGET_S / max(once, 1e-7)))))


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of a model's initializers, those left in external files included."""
    total = 0
    for tensor in model.graph.initializer:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        total += int(np.prod(tensor.dims, dtype=np.int64)) * itemsize
    return total


def replicated(model: onnx.ModelProto, copies: int) -> onnx.ModelProto:
    """`copies` copies of an isolated group side by side in one model, each with its own inputs, weights and outputs
    (names suffixed ``__rN``), so that onnxruntime can neither share nor merge their nodes."""
    if copies == 1:
        return model
    body = model.graph
    nodes, inputs, outputs, initializers = [], [], [], []
    for copy in range(copies):
        def rename(name: str) -> str:
            return f"{name}__r{copy}" if name else name

        for group, target in ((body.input, inputs), (body.output, outputs), (body.initializer, initializers)):
            for item in group:
                clone = type(item)()
                clone.CopyFrom(item)
                clone.name = rename(item.name)
                target.append(clone)
        for node in body.node:
            clone = onnx.NodeProto()
            clone.CopyFrom(node)
            clone.name = rename(node.name)
            clone.input[:] = [rename(n) for n in node.input]
            clone.output[:] = [rename(n) for n in node.output]
            nodes.append(clone)
    graph = helper.make_graph(nodes, body.name, inputs, outputs, initializer=initializers)
    return helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)


def probe_model(n_in: int, n_out: int) -> onnx.ModelProto:
    """A trivial model with `n_in` one-element inputs and `n_out` outputs: the per-call overhead of a session."""
    inputs = [helper.make_tensor_value_info(f"x{i}", onnx.TensorProto.FLOAT, [1]) for i in range(n_in)]
    outputs = [helper.make_tensor_value_info(f"y{j}", onnx.TensorProto.FLOAT, [1]) for j in range(n_out)]
    nodes = [helper.make_node("Identity", [f"x{j % n_in}"], [f"y{j}"]) for j in range(n_out)]
    body = helper.make_graph(nodes, "probe", inputs, outputs)
    return helper.make_model(body, opset_imports=[helper.make_opsetid("", 13)], ir_version=max_ir_version())


def reorder_probe(shape: tuple[int, ...]) -> onnx.ModelProto:
    """x -> ReorderInput -> ReorderOutput -> y: an NCHWc round trip of a tensor."""
    padded = [shape[0], -(-shape[1] // 4) * 4, *shape[2:]]  # ReorderInput takes channels in multiples of 4
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, padded)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(shape))
    nodes = [helper.make_node("ReorderInput", ["x"], ["b"], domain="com.microsoft.nchwc"),
             helper.make_node("ReorderOutput", ["b"], ["y"], domain="com.microsoft.nchwc", channels=shape[1])]
    body = helper.make_graph(nodes, "reorder", [x], [y])
    return helper.make_model(body, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft.nchwc", 1)],
                             ir_version=max_ir_version())


class Gauge:
    """How much slower than its best the machine runs right now, read from a reference model timed beside each pair.

    The reference is the one-input Identity probe, whose run is nothing but the per-call overhead.  On these shared
    machines the whole CPU runs 1.6-2x slower for stretches of seconds (a busy neighbour or sibling core): a group
    and its probe then both slow down by about that factor, so their difference (a group's cost) does too, while
    their ratio holds.  Scaling each difference by fastest / reference takes the factor out.

    The baseline (`fastest`) is the fastest reference run its cost model has seen, starting with `CALIBRATION_S` of
    timing before its first measurement, so that it is settled before any entry is scaled by it (a process's first
    reference runs are its slowest: 85 us against 51-56 us later).  Entries keep the scale they were measured with:
    an entry that changed later would change the cost of graphs an environment has already cached, a phantom reward
    of its own.  The baseline is not kept in the table, yet processes differ in it (47.0 to 55.5 us seen), and the
    entries that training processes wrote read 1.2-1.8x what a process alone on the machine measures for them now,
    though its own three measurements agree within 5%.  On DeiT-tiny, entries
    written while another seed trained on the other core read 1-4x what they measure alone, unevenly enough to
    reorder graphs (docs/agents.md).  So tables are filled one process at a time
    (benchmarks/agent-deploy/run.sh), and a table filled otherwise is measured again with `rlflow costmodel audit
    --refresh`; a reference with compute in it, its baseline kept in the table, remains the thing to try for a gauge
    that sees such a neighbour."""

    def __init__(self):
        self.fastest = math.inf
        self.model = probe_model(1, 1)

    def calibrate(self, settings: SessionSettings) -> None:
        """Times the reference alone for `CALIBRATION_S` (batches of about 2 ms) and keeps its fastest batch."""
        from rlflow.measure.timing import Runner

        runner = Runner(self.model, settings, random_inputs(self.model, 0))
        for _ in range(10):
            runner.run()
        runs = max(1, math.ceil(0.002 / max(runner.time(1), 1e-7)))
        deadline = time.perf_counter() + CALIBRATION_S
        while time.perf_counter() < deadline:
            self.fastest = min(self.fastest, runner.time(runs))


def time_beyond(model: onnx.ModelProto, probe: onnx.ModelProto, settings: SessionSettings, gauge: Gauge, *,
                 batch_s: float = 0.002, budget_s: float = 0.12, pairs: int | None = None) -> float:
    """Seconds per run of `model` beyond those of `probe` (the trivial model whose run is the per-call overhead).

    Batches of the two alternate and the fastest batch of each counts: the minimum, not the median, because the table
    is filled at different times on a shared machine and the fastest batch is the least disturbed; alternating, so that
    both minima come from the same stretch of time (the end-to-end check measures interleaved, where this matters
    less).  That difference is taken for `pairs` freshly built pairs of sessions (default `SESSION_PAIRS`) and the
    median counts: one session can stay slow for as long as it lives (a single Reshape of 4 KB timed 32.6 us in one
    table and 0.8-1.7 us when measured again), which no number of batches from that session corrects, and one pair
    whose probe caught the fast moments and whose group did not gives one difference far off.  The `gauge`'s
    reference model is timed in the same alternation and each difference is scaled by the machine's slowdown at the
    time (see `Gauge`).  The result may be negative for a group cheaper than the probe's Identity nodes.
    """
    from rlflow.measure.timing import Runner

    pairs = pairs or SESSION_PAIRS
    timed = [model, probe, gauge.model]
    differences, references = [], []
    for _ in range(pairs):
        runners = [Runner(m, settings, random_inputs(m, 0)) for m in timed]
        for runner in runners:
            for _ in range(2):
                runner.run()
        firsts = [max(runner.time(1), 1e-7) for runner in runners]
        runs = [max(1, math.ceil(batch_s / first)) for first in firsts]
        batches = int(min(15, max(5, budget_s / pairs / sum(n * first for n, first in zip(runs, firsts)))))
        best = [math.inf] * len(runners)
        for _ in range(batches):
            for k, runner in enumerate(runners):
                best[k] = min(best[k], runner.time(runs[k]))
        differences.append(best[0] - best[1])
        references.append(best[2])
    gauge.fastest = min(gauge.fastest, *references)
    return float(np.median([d * gauge.fastest / r for d, r in zip(differences, references)]))

"""A TASO-style cost model: a graph's latency is the sum of the latencies of its parts measured in isolation.

TASO sums per-operator times.  On onnxruntime that overestimates, because onnxruntime fuses Conv+BN+activation
(+ residual Add under NCHWc), MatMul+Add into Gemm, bias+GELU, Add+LayerNorm into SkipLayerNorm, Transpose or a
scale into FusedMatMul, and folds constant subgraphs.  So the unit measured here is a *fusion group*:

1. Static nodes (every input constant, or a Shape of a static-shaped tensor) cost 0: onnxruntime folds them.
2. The rest is partitioned into groups that contain whatever onnxruntime could fuse into one kernel: a compute
   operator (Conv, MatMul, Gemm...) with its single-consumer elementwise epilogue (BN, bias, activation, residual Add,
   LayerNorm), a Transpose or scale feeding a MatMul, and connected regions of elementwise operators (GELU, LayerNorm
   and Softmax patterns).  A group holds at most one compute operator and `MAX_GROUP` nodes.
3. Each distinct group configuration (operators, attributes, shapes, dtypes, which inputs are weights; weights are
   described by shape, integer and scalar constants by value) is cut out as a small ONNX model with random weights
   and run through onnxruntime with the target settings, so onnxruntime applies its own fusions inside the group.
   The optimised graph onnxruntime saves for it is hashed too, so groups that onnxruntime turns into the same kernels
   (a Conv after a BN fold and a Conv+BN) share one measurement and get exactly the same cost.
4. Times are the fastest of several batched runs (of up to `MAX_REPLICAS` copies of a small group side by side, so
   that its microseconds rise above the noise of the call overhead), minus the per-call overhead of a trivial
   session with as many inputs and outputs (so Python's per-call cost is not counted once per group) and minus the
   NCHWc reorders onnxruntime adds at the edges of an isolated group (inside the whole graph, NCHWc convolutions pass
   blocked tensors to each other without them).  The overhead is timed in batches alternating with the group's own,
   every time a group is measured: the difference is a few microseconds on small groups, so an overhead timed once
   and reused would turn one busy moment into a bias on every group measured after it.

The table is cached on disk as JSON, keyed by provider, session settings, machine and onnxruntime version.  After
warm-up `graph_cost` is a pure-Python pass over the graph with dictionary look-ups.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import platform
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper, numpy_helper
from onnx_graphsurgeon.exporters.onnx_exporter import OnnxExporter

from rlflow.graph import Graph, external_reference, max_ir_version
from rlflow.measure.group_shapes import Shapes
from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings, inference_session, session_options

log = logging.getLogger("rlflow")

CACHE_VERSION = 4
"""Bump when what a table entry means changes (grouping, measurement procedure): old tables are then ignored.

2: the per-call overhead is timed alongside each group (version 1 timed it once per input/output count and cached
it; one such entry timed 84 us against a true 48 us and floored 39% of a table's groups).
3: each entry is the fastest over `SESSION_PAIRS` freshly built session pairs (version 2 used one: a Reshape of
4 KB stayed at 32.6 us against 0.8-1.7 us re-measured, and made one attention-unfuse on vit-b-16-tiny cost 55% of
the model's estimate where end-to-end measurement puts the two graphs within a few percent of each other).
4: a group faster than `REPLICA_TARGET_S` is timed as up to `MAX_REPLICAS` copies in one model, and each entry is the
median over three session pairs (version 3 timed one copy, whose few microseconds were the size of the noise of the
per-call overhead subtracted from them: on nasrnn-tiny a Gemm+Tanh+Add+Sigmoid+Add+Tanh+Mul+Tanh group was cached
at 33.1 us against 2.6-13.3 us measured again, a phantom reward of -36.6% for one rewrite and +37.6% for the next
(docs/results/costmodel-audit-v3.md).  Four one-copy measurements of a group spread by 2.7-3.3 us (median over 30
groups), replicated ones by 0.4-0.7 us); and each difference is scaled by the machine's slowdown at the time it was
taken, read from a reference model timed beside it (`_Gauge`: in stretches when everything ran 1.6-2x slower, a
group's difference doubled while its ratio to the probe held)."""

TABLES = Path(__file__).resolve().parent / "tables"
"""Cost tables measured on devices and shipped with the package (with the estimates fitted to them)."""

CALIBRATION_S = 0.3
"""Seconds a process times the slowdown gauge's reference before its first measurement (see `_Gauge`)."""

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

MAX_GROUP = 16
"""Most non-static nodes in one fusion group (bounds measurement size and keeps keys reusable)."""

AUTOSAVE_EVERY = 20
"""New table entries after which the table is written to disk."""

HEAVY = frozenset({
    "Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "MatMulInteger", "ConvInteger", "QLinearConv", "QLinearMatMul",
    "FusedConv", "FusedMatMul", "FusedGemm", "Attention", "MultiHeadAttention", "LSTM", "GRU", "RNN",
})
"""Compute operators: each anchors its own group (a group holds at most one)."""

FUSIBLE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Exp", "Log", "Neg", "Reciprocal", "Abs", "Erf", "Max", "Min", "Sum",
    "Relu", "LeakyRelu", "Elu", "Selu", "Celu", "PRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
    "Softplus", "Softsign", "Mish", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "BatchNormalization",
    "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization", "InstanceNormalization",
    "Softmax", "LogSoftmax", "ReduceMean", "Where", "Equal", "Not", "Cast",
})
"""Elementwise and normalisation operators onnxruntime fuses with their neighbours."""

PROLOGUE = frozenset({"Transpose", "Mul", "Div"})
"""Operators onnxruntime folds into a following MatMul (FusedMatMul transposes and alpha)."""

MATMUL_LIKE = frozenset({"MatMul", "Gemm", "FusedMatMul"})

_NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                               "Bernoulli"})
_SHAPE_OPS = frozenset({"Shape", "Size"})
_FLOOR_MS = 1e-4
"""Smallest cost of a measured group (0.1 us): costs stay positive whatever the overhead subtraction gives."""


@dataclass
class CostStats:
    """Counters: group look-ups answered from the table (hits) or not (misses), and what the misses cost."""

    hits: int = 0
    misses: int = 0
    measured: int = 0
    canonical_hits: int = 0
    measure_seconds: float = 0.0
    failures: int = 0
    estimated: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Group:
    """One fusion group of a graph: its nodes (static ancestors first), anchor and configuration key."""

    nodes: list
    members: list  # the non-static nodes (the ones that run)
    anchor: str
    key: str
    shapes: "Shapes"


def machine_id() -> str:
    """CPU model name and core count (plus the GPU name where one is visible): what a cost table is valid on."""
    name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    name = name or platform.processor() or platform.machine()
    text = f"{name} x{os.cpu_count()}"
    gpus = sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")) if Path("/proc/driver/nvidia/gpus").exists() else []
    for info in gpus[:1]:
        try:
            model = next(line.split(":", 1)[1].strip() for line in info.read_text().splitlines() if line.startswith("Model"))
            text += f" + {model}"
        except (OSError, StopIteration):
            pass
    return text


def default_cache_dir() -> Path:
    """``$RLFLOW_CACHE/costmodel`` when RLFLOW_CACHE is set, else ``~/.cache/rlflow/costmodel``."""
    from rlflow.files import cache_dir

    return cache_dir("costmodel")


class CostModel:
    """Estimated latency of a graph = sum of per-operator costs measured in isolation (cached).

    The operators are measured as onnxruntime fusion groups (see the module docstring), so nodes that onnxruntime fuses
    into a neighbour cost 0 and the group's cost is carried by its anchor (the compute operator, else the first node).

    A search with a time limit sets `deadline` (`measuring_until`): past it, no group is measured any more, and a
    group the table lacks costs what `rlflow.measure.fallback` estimates from its size instead (the same estimate for
    the same configuration until the block ends, so that graph costs stay comparable; estimates are never written to
    the table).  Within one graph, groups are looked up first and the misses measured largest estimate
    first, so the time goes to the groups that weigh most.  `coverage` says what was measured and what estimated.

    Args:
        settings: the session settings estimates are for (default: CPU, 1 thread, ORT_ENABLE_ALL).
        cache_dir: folder of the JSON table (default `default_cache_dir()`).

    Example:
        >>> model = CostModel()                      # doctest: +SKIP
        >>> model.graph_cost(rlflow.load("m.onnx"))  # doctest: +SKIP
        12.3
    """

    def __init__(self, settings: SessionSettings | None = None, cache_dir: str | Path | None = None):
        self.settings = settings or SessionSettings()
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.stats = CostStats()
        self._table: dict | None = None
        self._new = 0
        self._failed: set[str] = set()  # groups that cannot be measured (kept in memory only: a fix may come)
        self._lock = threading.Lock()
        self._gauge: _Gauge | None = None
        self.deadline: float | None = None
        self._fallback = None  # rlflow.measure.fallback.Fallback, made when a deadline is first set
        self._unmeasured: dict[str, float] = {}  # group key -> the estimate it got when time had run out
        self._seen: dict[str, str] = {}  # group key -> table | measured | estimated | failed, while a deadline is set
        self._durations: list[float] = []  # seconds of each group measurement (for predicting the next)
        import onnxruntime as ort

        self.key = {
            "version": CACHE_VERSION,
            "provider": self.settings.provider,
            "threads": self.settings.threads,
            "opt_level": self.settings.opt_level,
            "execution_mode": self.settings.execution_mode,
            "machine": machine_id(),
            "onnxruntime": ort.__version__,
        }
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = self.cache_dir / f"costmodel-{digest}.json"
        _live.add(self)

    # ------------------------------------------------------------------------------------------------ public
    def graph_cost(self, graph: Graph) -> float:
        """Estimated end-to-end latency of `graph` in milliseconds."""
        return float(sum(self._costs(graph, self.groups(graph))))

    def node_costs(self, graph: Graph) -> dict[str, float]:
        """Node name -> estimated ms: a group's cost on its anchor, 0 for the nodes fused into it and static nodes."""
        costs = {node.name: 0.0 for node in graph.gs.nodes}
        groups = self.groups(graph)
        for group, cost in zip(groups, self._costs(graph, groups)):
            costs[group.anchor] += cost
        return costs

    @contextmanager
    def measuring_until(self, deadline: float | None):
        """Within the block, no group measurement starts that would end after `deadline` (a `time.monotonic()`
        value; None: no limit); the misses then are estimated (see the class docstring).  The outermost block starts
        `coverage` afresh, and its estimates end with it: a later search may measure those groups."""
        previous = self.deadline
        if previous is None:
            self._seen, self._unmeasured = {}, {}
        self.deadline = deadline
        if deadline is not None and self._fallback is None:
            from rlflow.measure.fallback import Fallback

            self._fallback = Fallback(self.settings.provider)
        try:
            yield self
        finally:
            self.deadline = previous
            if previous is None:
                self._unmeasured = {}

    def coverage(self) -> dict:
        """The distinct group configurations met while a deadline was set, by where their cost came from: `table`
        (cached before), `measured` (now), `estimated` (no time left to measure), `failed` (cannot be measured), and
        the estimate's source."""
        counts = {"groups": len(self._seen), "table": 0, "measured": 0, "estimated": 0, "failed": 0}
        for origin in self._seen.values():
            counts[origin] += 1
        counts["estimate"] = self._fallback.source if counts["estimated"] else None
        return counts

    def _costs(self, graph: Graph, groups: list[_Group]) -> list[float]:
        """The cost of each group; with a deadline, the known ones first, then the misses largest estimate first."""
        if self.deadline is None:
            return [self._group_cost(graph, g) for g in groups]
        known, misses = [], []
        for i, group in enumerate(groups):
            (misses if self._missing(group.key) else known).append(i)
        if misses:
            guess: dict[str, float] = {}
            for i in misses:
                if groups[i].key not in guess:
                    guess[groups[i].key] = self._fallback(groups[i])
            misses.sort(key=lambda i: -guess[groups[i].key])
        costs = [0.0] * len(groups)
        for i in known + misses:
            costs[i] = self._group_cost(graph, groups[i])
        return costs

    def _missing(self, key: str) -> bool:
        """Whether the table lacks the cost of this group configuration (and nothing else answers for it)."""
        canon = self.table["groups"].get(key)
        return ((canon is None or canon not in self.table["costs"]) and key not in self._failed
                and key not in self._unmeasured)

    def _out_of_time(self) -> bool:
        """Whether a group measurement started now would end after the deadline (the median of the last ones)."""
        if self.deadline is None:
            return False
        recent = sorted(self._durations[-9:])
        typical = recent[len(recent) // 2] if recent else 0.0
        return time.monotonic() + typical > self.deadline

    def save(self) -> None:
        """Writes the table atomically, merged with whatever another process wrote to the same file meanwhile."""
        with self._lock:
            if self._table is None or not self._new:
                return
            on_disk = self._read()
            for section in ("groups", "costs", "ops"):
                on_disk[section].update(self._table[section])
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=self.path.name, suffix=".tmp", dir=self.cache_dir)
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(on_disk, f, indent=0, sort_keys=True)
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            self._table = on_disk
            self._new = 0

    def __del__(self) -> None:
        try:
            self.save()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __len__(self) -> int:
        """Number of measured configurations in the table."""
        return len(self.table["costs"])

    @property
    def table(self) -> dict:
        """The table, loaded from disk on first use."""
        if self._table is None:
            with self._lock:
                if self._table is None:
                    self._table = self._read()
        return self._table

    # -------------------------------------------------------------------------------------------- partition
    def groups(self, graph: Graph) -> list[_Group]:
        """The fusion groups of `graph`, in node order (static nodes belong to no group)."""
        nodes = list(graph.gs.nodes)
        static = _static_nodes(graph, nodes)
        outputs = {id(t) for t in graph.gs.outputs}
        index = {id(n): i for i, n in enumerate(nodes)}
        parent = list(range(len(nodes)))
        heavy = [1 if n.op in HEAVY else 0 for n in nodes]
        size = [1] * len(nodes)

        def find(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        def union(a: int, b: int) -> None:
            ra, rb = find(a), find(b)
            if ra == rb or heavy[ra] + heavy[rb] > 1 or size[ra] + size[rb] > MAX_GROUP:
                return
            parent[rb] = ra
            heavy[ra] += heavy[rb]
            size[ra] += size[rb]

        for i, node in enumerate(nodes):
            if i in static:
                continue
            op = node.op
            for tensor in node.outputs:
                consumers = [c for c in tensor.outputs if id(c) in index and index[id(c)] not in static]
                if not consumers or id(tensor) in outputs:
                    continue
                if op in HEAVY:
                    if len(consumers) == 1 and consumers[0].op in FUSIBLE:
                        union(i, index[id(consumers[0])])
                elif op in FUSIBLE and all(c.op in FUSIBLE for c in consumers):
                    for consumer in consumers:
                        union(i, index[id(consumer)])
                if (op in PROLOGUE and len(consumers) == 1 and consumers[0].op in MATMUL_LIKE
                        and (op == "Transpose" or _has_scalar_constant(node))):
                    union(index[id(consumers[0])], i)
        shapes = Shapes(graph)
        members: dict[int, list[int]] = {}
        for i in range(len(nodes)):
            if i not in static:
                members.setdefault(find(i), []).append(i)
        groups = []
        for ids in members.values():
            run = [nodes[i] for i in ids]
            ancestors = _static_ancestors(run, static, index)
            ordered = [nodes[i] for i in sorted(set(ids) | ancestors)]
            anchor = next((n for n in run if n.op in HEAVY), run[0])
            key = _group_key(shapes, ordered, {id(n) for n in ordered}, outputs)
            groups.append(_Group(ordered, run, anchor.name, key, shapes))
        return groups

    # ------------------------------------------------------------------------------------------ measurement
    def _group_cost(self, graph: Graph, group: _Group) -> float:
        table = self.table
        canon = table["groups"].get(group.key)
        if canon is not None:
            cost = table["costs"].get(canon)
            if cost is not None:
                self.stats.hits += 1
                self._note(group, "table", cost)
                return cost
        if group.key in self._failed:
            self.stats.hits += 1
            return 0.0
        cost = self._unmeasured.get(group.key)
        if cost is None and self._out_of_time():
            cost = self._unmeasured[group.key] = self._fallback(group)
            self._seen[group.key] = "estimated"
        if cost is not None:
            self.stats.estimated += 1
            return cost
        self.stats.misses += 1
        start = time.perf_counter()
        try:
            cost = self._measure_group(graph, group)
            self._note(group, "measured", cost)
        except Exception as exc:  # noqa: BLE001 - an unmeasurable group must not stop a search; it is logged
            self.stats.failures += 1
            self._failed.add(group.key)
            self._note(group, "failed", None)
            log.warning("cost model: cannot measure group at %s (%s); counted as 0", group.anchor, exc)
            cost = 0.0
        self._durations.append(time.perf_counter() - start)
        self.stats.measure_seconds += self._durations[-1]
        return cost

    def _note(self, group: _Group, origin: str, cost: float | None) -> None:
        """Records where a group's cost came from (for `coverage`) and shows it to the fallback estimate; only while
        a deadline is set, so that an unlimited search pays nothing for it."""
        if self.deadline is None or group.key in self._seen:
            return
        self._seen[group.key] = origin
        if cost is not None:
            self._fallback.learn(group.key, group, cost)

    def _measure_group(self, graph: Graph, group: _Group) -> float:
        model = _isolated_model(graph, group)
        optimized = self._optimized(model)
        canon = ("o:" + _optimized_key(optimized)) if optimized is not None else group.key
        table = self.table
        with self._lock:
            table["groups"][group.key] = canon
            self._new += 1
        cost = table["costs"].get(canon)
        if cost is None:
            cost = self._time_isolated(model, optimized)
            with self._lock:
                table["costs"][canon] = cost
                table["ops"][canon] = "+".join(n.op for n in group.members)
            self.stats.measured += 1
        else:
            self.stats.canonical_hits += 1
        if self._new >= AUTOSAVE_EVERY:
            self.save()
        return cost

    def _time_isolated(self, model: onnx.ModelProto, optimized: onnx.ModelProto | None) -> float:
        """Milliseconds of an isolated group (`_isolated_model`) beyond the call overhead and its boundary reorders:
        what the table stores for it (`optimized`: `_optimized(model)`).

        A group that runs in less than `REPLICA_TARGET_S` is timed as independent copies in one model (as many as
        bring one run to that time, at most `MAX_REPLICAS`), and the time is divided among them: the per-call
        overhead and its noise are then paid once for all the copies.
        """
        copies = self._replicas(model)
        replicated = _replicated(model, copies)
        probe = _probe_model(max(len(replicated.graph.input), 1), max(len(replicated.graph.output), 1))
        seconds = _time_beyond(replicated, probe, self.settings, self.gauge) / copies
        boundary = self._boundary_reorders(optimized) if optimized is not None else 0.0
        return max(seconds * 1e3 - boundary, _FLOOR_MS)

    def _replicas(self, model: onnx.ModelProto) -> int:
        """How many copies of an isolated group make one run last about `REPLICA_TARGET_S` (1 to `MAX_REPLICAS`)."""
        from rlflow.measure.timing import Runner

        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for node in model.graph.node for a in node.attribute):
            return 1  # a subgraph may name outer tensors, which the copies rename
        most = MAX_REPLICA_BYTES // max(_weight_bytes(model), 1)
        if most <= 1:
            return 1
        runner = Runner(model, self.settings, random_inputs(model, 0))
        for _ in range(2):
            runner.run()
        once = min(runner.time(1) for _ in range(3))
        return int(min(MAX_REPLICAS, most, max(1, math.ceil(REPLICA_TARGET_S / max(once, 1e-7)))))

    @property
    def gauge(self) -> "_Gauge":
        """The slowdown gauge of this cost model's measurements, calibrated before its first one."""
        if self._gauge is None:
            self._gauge = _Gauge()
            self._gauge.calibrate(self.settings)
        return self._gauge

    def cached_key(self, graph: Graph, group: _Group) -> str | None:
        """The cost key the table holds for one group of `graph` (found through onnxruntime's optimised form where
        the group itself was never met, as `_measure_group` finds it), or None where no cost is cached for it."""
        canon = self.table["groups"].get(group.key)
        if canon is None:
            optimized = self._optimized(_isolated_model(graph, group))
            canon = ("o:" + _optimized_key(optimized)) if optimized is not None else group.key
        return canon if canon in self.table["costs"] else None

    def remeasure(self, graph: Graph, group: _Group, times: int = 1) -> list[float]:
        """`times` fresh measurements of one group of `graph`, each as the table would store it, leaving the table
        as it is (see `rlflow.measure.costmodel_audit`)."""
        model = _isolated_model(graph, group)
        optimized = self._optimized(model)
        return [self._time_isolated(model, optimized) for _ in range(times)]

    def _boundary_reorders(self, optimized: onnx.ModelProto) -> float:
        """Milliseconds of the NCHWc reorders onnxruntime adds at the edges of an isolated group.

        Inside a whole graph, consecutive NCHWc operators pass blocked tensors to each other; cut out alone, a group
        converts its inputs to NCHWc and its outputs back, which the whole graph does not pay for.
        """
        shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
                  for vi in list(optimized.graph.input) + list(optimized.graph.output)}
        total = 0.0
        for node in optimized.graph.node:
            if node.domain != "com.microsoft.nchwc" or node.op_type not in ("ReorderInput", "ReorderOutput"):
                continue
            name = node.input[0] if node.op_type == "ReorderInput" else node.output[0]
            shape = shapes.get(name)
            if shape and len(shape) == 4 and all(d > 0 for d in shape):
                total += self._reorder_cost(tuple(shape))
        return total

    def _reorder_cost(self, shape: tuple[int, ...]) -> float:
        """One NCHW<->NCHWc reorder of a tensor of this shape: half a ReorderInput+ReorderOutput round trip (cached)."""
        key = "reorder:" + "x".join(map(str, shape))
        cost = self.table["costs"].get(key)
        if cost is None:
            basic = SessionSettings(self.settings.provider, self.settings.threads, "basic", self.settings.execution_mode)
            seconds = _time_beyond(_reorder_probe(shape), _probe_model(1, 1), basic, self.gauge)
            cost = max(seconds * 1e3, 0.0) / 2
            with self._lock:
                self.table["costs"][key] = cost
                self._new += 1
        return cost

    def _optimized(self, model: onnx.ModelProto) -> onnx.ModelProto | None:
        """The graph onnxruntime optimises the isolated group into (weights left on disk), or None."""
        options = session_options(self.settings)
        with tempfile.TemporaryDirectory(prefix="rlflow-cost-") as tmp:
            path = os.path.join(tmp, "optimized.onnx")
            options.optimized_model_filepath = path
            options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "weights.bin")
            options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
            providers = [self.settings.provider] + (["CPUExecutionProvider"]
                                                    if self.settings.provider != "CPUExecutionProvider" else [])
            try:
                inference_session(model, options, providers)
                return onnx.load(path, load_external_data=False)
            except Exception as exc:  # noqa: BLE001 - some providers cannot save optimised models
                log.debug("cost model: no optimised graph (%s)", exc)
                return None

    # ---------------------------------------------------------------------------------------------- storage
    def _read(self) -> dict:
        empty = {"key": self.key, "groups": {}, "costs": {}, "ops": {}}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            data = shipped_table(self.key) or empty
        if data.get("key") != self.key:
            return empty
        for section in ("groups", "costs", "ops"):
            data.setdefault(section, {})
        return data


def shipped_table(key: dict) -> dict | None:
    """A table shipped in `TABLES` measured under exactly `key` (machine, onnxruntime, provider, settings), or None.

    TASO measures each configuration once per device; a machine of a kind the project has measured (the GPU kit's H100)
    then starts from that table instead of an empty one, and searches spend their time on configurations it lacks.
    """
    for path in sorted(TABLES.glob("*.json")):
        if path.name.endswith(".estimate.json"):
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("key") == key:
            return data
    return None


_live: "weakref.WeakSet[CostModel]" = weakref.WeakSet()


@atexit.register
def _save_all() -> None:
    for model in list(_live):
        try:
            model.save()
        except Exception:  # noqa: BLE001 - never fail interpreter exit
            pass


# ------------------------------------------------------------------------------------------------- helpers
def _static_nodes(graph: Graph, nodes: list) -> set[int]:
    """Indices of nodes onnxruntime folds away: every input constant (or folded), or Shape/Size of a static shape."""
    folded: set[int] = set()
    static_tensors: set[int] = set()
    for i, node in enumerate(nodes):
        if node.op in _NONDETERMINISTIC:
            continue
        if node.op in _SHAPE_OPS:
            ok = node.inputs and graph.shape(node.inputs[0]) is not None
        else:
            ok = all(isinstance(t, gs.Constant) or id(t) in static_tensors or not t.name for t in node.inputs)
            ok = ok and bool(node.inputs)
        if ok:
            folded.add(i)
            static_tensors.update(id(t) for t in node.outputs)
    return folded


def _static_ancestors(run: list, static: set[int], index: dict[int, int]) -> set[int]:
    """Static nodes whose outputs a group reads (transitively), which its isolated model must compute."""
    found: set[int] = set()
    stack = [t for n in run for t in n.inputs]
    while stack:
        tensor = stack.pop()
        if not tensor.inputs:
            continue
        producer = tensor.inputs[0]
        i = index.get(id(producer))
        if i is None or i not in static or i in found:
            continue
        found.add(i)
        if producer.op not in _SHAPE_OPS:
            stack.extend(producer.inputs)
    return found


def _has_scalar_constant(node) -> bool:
    return any(isinstance(t, gs.Constant) and t.values.size == 1 for t in node.inputs)


def _constant_desc(tensor: gs.Constant) -> tuple:
    """Weights are described by shape; integer, boolean and scalar constants by value (they steer kernels)."""
    values = tensor.values
    dtype = str(values.dtype)
    if values.dtype.kind == "f" and values.size > 1:
        return ("w", dtype, values.shape)
    array = np.require(values, requirements="C")
    return ("c", dtype, values.shape, hashlib.blake2b(array.tobytes(), digest_size=8).hexdigest())


def _attr_desc(value) -> str:
    if isinstance(value, gs.Constant):
        return repr(_constant_desc(value))
    if isinstance(value, gs.Graph):
        return "graph:" + hashlib.blake2b(gs.export_onnx(value, do_type_check=False).graph.SerializeToString(),
                                          digest_size=8).hexdigest()
    if isinstance(value, np.ndarray):
        return repr((str(value.dtype), value.shape, value.tobytes()))
    return repr(value)


def _group_key(shapes: "Shapes", ordered: list, inside: set[int], outputs: set[int]) -> str:
    """The configuration of a group: structure, attributes, shapes and dtypes; not names, not weight values."""
    local: dict[int, tuple] = {}
    externals: dict[int, int] = {}
    parts = []
    for k, node in enumerate(ordered):
        operands = []
        for tensor in node.inputs:
            if not tensor.name:
                operands.append("-")
            elif id(tensor) in local:
                operands.append(local[id(tensor)])
            elif isinstance(tensor, gs.Constant):
                operands.append(_constant_desc(tensor))
            else:
                if id(tensor) not in externals:
                    externals[id(tensor)] = len(externals)
                    shape, dtype = shapes.get(tensor)
                    parts.append(("in", str(dtype), shape))
                operands.append(("x", externals[id(tensor)]))
        escapes = []
        for j, tensor in enumerate(node.outputs):
            local[id(tensor)] = (k, j)
            if tensor.name and (id(tensor) in outputs or any(id(c) not in inside for c in tensor.outputs)):
                escapes.append(j)
        attrs = tuple(sorted((key, _attr_desc(v)) for key, v in node.attrs.items()))
        parts.append((node.domain or "", node.op, attrs, tuple(operands), len(node.outputs), tuple(escapes)))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _isolated_model(graph: Graph, group: _Group) -> onnx.ModelProto:
    """The group as a model of its own: external inputs become graph inputs, weights random, escapes outputs."""
    inside = {id(n) for n in group.nodes}
    graph_outputs = {id(t) for t in graph.gs.outputs}
    produced: set[int] = set()
    inputs, initializers, outputs, seen = [], [], [], set()
    rng = np.random.default_rng(0)
    for node in group.nodes:
        for tensor in node.inputs:
            if not tensor.name or id(tensor) in produced or tensor.name in seen:
                continue
            seen.add(tensor.name)
            if isinstance(tensor, gs.Constant):
                reference = external_reference(tensor.name, tensor.values)
                if reference is not None:  # weights left in their file: the real ones, never a copy of gigabytes
                    initializers.append(reference)
                    continue
                values = np.asarray(tensor.values)
                if values.dtype.kind == "f" and values.size > 1:
                    values = rng.uniform(0.5, 1.5, size=values.shape).astype(values.dtype)
                initializers.append(numpy_helper.from_array(np.require(values, requirements="C"), tensor.name))
            else:
                shape, dtype = group.shapes.get(tensor)
                if shape is None or dtype is None:
                    raise ValueError(f"tensor {tensor.name!r} has no static shape or dtype")
                elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
                inputs.append(helper.make_tensor_value_info(tensor.name, elem, list(shape)))
        for tensor in node.outputs:
            produced.add(id(tensor))
    for node in group.members:
        for tensor in node.outputs:
            if tensor.name and (id(tensor) in graph_outputs or any(id(c) not in inside for c in tensor.outputs)):
                outputs.append(_value_info(group.shapes, tensor))
    if not outputs:  # a dead end (its results unused): keep its last outputs so nothing is pruned
        outputs = [_value_info(group.shapes, t) for t in group.members[-1].outputs if t.name]
    nodes = [OnnxExporter.export_node(n) for n in group.nodes]
    domains = dict(graph.model_info["opset_import"])
    for node in group.nodes:
        if node.domain and node.domain not in domains:
            domains[node.domain] = 1
    opsets = [helper.make_opsetid(d, v) for d, v in domains.items()]
    body = helper.make_graph(nodes, "group", inputs, outputs, initializer=initializers)
    return helper.make_model(body, opset_imports=opsets, ir_version=max_ir_version())


def _weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of a model's initializers, those left in external files included."""
    total = 0
    for tensor in model.graph.initializer:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type)).itemsize
        total += int(np.prod(tensor.dims, dtype=np.int64)) * itemsize
    return total


def _replicated(model: onnx.ModelProto, copies: int) -> onnx.ModelProto:
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


def _value_info(shapes: "Shapes", tensor) -> onnx.ValueInfoProto:
    shape, dtype = shapes.get(tensor)
    if dtype is None:
        return helper.make_empty_tensor_value_info(tensor.name)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return helper.make_tensor_value_info(tensor.name, elem, list(shape) if shape is not None else None)


def _optimized_key(model: onnx.ModelProto) -> str:
    """A structural hash of an onnxruntime-optimised model (names and weight values left out)."""
    graph = model.graph
    initializers = {}
    for t in graph.initializer:
        external = t.data_location == onnx.TensorProto.EXTERNAL
        size = int(np.prod(t.dims)) if t.dims else 1
        floating = t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                                   onnx.TensorProto.BFLOAT16)
        if external or (floating and size > 1):
            initializers[t.name] = ("w", t.data_type, tuple(t.dims))
        else:
            initializers[t.name] = ("c", t.data_type, tuple(t.dims),
                                    hashlib.blake2b(numpy_helper.to_array(t).tobytes(), digest_size=8).hexdigest())
    refs: dict[str, tuple] = {}
    parts = []
    for k, vi in enumerate(graph.input):
        dims = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
        refs[vi.name] = ("in", k)
        parts.append(("in", vi.type.tensor_type.elem_type, dims))
    for k, node in enumerate(graph.node):
        operands = [refs.get(name) or initializers.get(name) or ("?" if name else "-") for name in node.input]
        attrs = tuple(sorted((a.name, _proto_attr(a)) for a in node.attribute))
        parts.append((node.domain, node.op_type, attrs, tuple(operands)))
        for j, name in enumerate(node.output):
            refs[name] = (k, j)
    parts.append(("out", tuple(refs.get(o.name) or initializers.get(o.name) for o in graph.output)))
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).hexdigest()


def _proto_attr(attr: onnx.AttributeProto) -> str:
    if attr.type == onnx.AttributeProto.TENSOR:
        return repr((attr.t.data_type, tuple(attr.t.dims), hashlib.blake2b(attr.t.SerializeToString(),
                                                                           digest_size=8).hexdigest()))
    if attr.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
        return hashlib.blake2b(attr.SerializeToString(), digest_size=8).hexdigest()
    return repr(helper.get_attribute_value(attr))


def _probe_model(n_in: int, n_out: int) -> onnx.ModelProto:
    """A trivial model with `n_in` one-element inputs and `n_out` outputs: the per-call overhead of a session."""
    inputs = [helper.make_tensor_value_info(f"x{i}", onnx.TensorProto.FLOAT, [1]) for i in range(n_in)]
    outputs = [helper.make_tensor_value_info(f"y{j}", onnx.TensorProto.FLOAT, [1]) for j in range(n_out)]
    nodes = [helper.make_node("Identity", [f"x{j % n_in}"], [f"y{j}"]) for j in range(n_out)]
    body = helper.make_graph(nodes, "probe", inputs, outputs)
    return helper.make_model(body, opset_imports=[helper.make_opsetid("", 13)], ir_version=max_ir_version())


def _reorder_probe(shape: tuple[int, ...]) -> onnx.ModelProto:
    """x -> ReorderInput -> ReorderOutput -> y: an NCHWc round trip of a tensor."""
    padded = [shape[0], -(-shape[1] // 4) * 4, *shape[2:]]  # ReorderInput takes channels in multiples of 4
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, padded)
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, list(shape))
    nodes = [helper.make_node("ReorderInput", ["x"], ["b"], domain="com.microsoft.nchwc"),
             helper.make_node("ReorderOutput", ["b"], ["y"], domain="com.microsoft.nchwc", channels=shape[1])]
    body = helper.make_graph(nodes, "reorder", [x], [y])
    return helper.make_model(body, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.microsoft.nchwc", 1)],
                             ir_version=max_ir_version())


class _Gauge:
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
    though its own three measurements agree within 5% (docs/results/costmodel-audit.md): a reference with compute in
    it, and its baseline kept in the table so that every process scales to one reference, is the next thing to try."""

    def __init__(self):
        self.fastest = math.inf
        self.model = _probe_model(1, 1)

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


def _time_beyond(model: onnx.ModelProto, probe: onnx.ModelProto, settings: SessionSettings, gauge: _Gauge, *,
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
    time (see `_Gauge`).  The result may be negative for a group cheaper than the probe's Identity nodes.
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


def spearman(x: Iterable[float], y: Iterable[float]) -> float:
    """Spearman's rank correlation (ties get average ranks); NaN when either side is constant."""
    a, b = np.asarray(list(x), dtype=float), np.asarray(list(y), dtype=float)
    if len(a) != len(b):
        raise ValueError("spearman needs two sequences of the same length")
    if len(a) < 2:
        return float("nan")
    ra, rb = rankdata(a), rankdata(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else float("nan")


def rankdata(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the average of the ranks they span (as scipy.stats.rankdata's 'average')."""
    values = np.asarray(values, dtype=float)
    order = np.argsort(values, kind="mergesort")
    sorted_values = values[order]
    ranks = np.empty(len(values), dtype=float)
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end + 1) / 2.0
            start = end
    return ranks

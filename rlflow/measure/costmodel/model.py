"""A TASO-style cost model: a graph's latency is the sum of the latencies of its parts measured in isolation.

TASO sums per-operator times.  On onnxruntime that overestimates, because onnxruntime fuses and folds operators, so
the unit measured here is a *fusion group* (`rlflow.measure.costmodel.groups`: the partition, the groups' configuration keys,
and each group cut out as a small model with random weights, run through onnxruntime with the target settings so that
onnxruntime applies its own fusions inside it).  Groups that onnxruntime optimises into the same graph share one
measurement and get exactly the same cost.  A group's cost is its time beyond the per-call overhead
(`rlflow.measure.costmodel.group_timing`), minus the NCHWc reorders onnxruntime adds at the edges of an isolated group.

The table is cached on disk as JSON, keyed by provider, session settings, machine and onnxruntime version.  After
warm-up `graph_cost` is a pure-Python pass over the graph with dictionary look-ups.
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import onnx

from rlflow.graph.core import Graph
from rlflow.measure.costmodel.group_timing import Gauge, probe_model, reorder_probe, replicas, replicated, time_beyond
from rlflow.measure.costmodel.groups import Group, isolated_model, optimized_key, partition
from rlflow.measure.costmodel.table import (
    CACHE_VERSION,
    TableStorage,
    default_cache_dir,
    live,
    machine_id,
    table_file_name,
)
from rlflow.measure.session import SessionSettings, inference_session, session_options

log = logging.getLogger("rlflow")

AUTOSAVE_EVERY = 20
"""New table entries after which the table is written to disk."""

RECENT_DURATIONS = 9
"""Group measurements whose median predicts the next one's duration (`measuring_until`)."""

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


class CostModel(TableStorage):
    """Estimated latency of a graph = sum of per-operator costs measured in isolation (cached).

    The operators are measured as onnxruntime fusion groups (`rlflow.measure.costmodel.groups`), so nodes that onnxruntime fuses
    into a neighbour cost 0 and the group's cost is carried by its anchor (the compute operator, else the first node).

    A search with a time limit sets `deadline` (`measuring_until`): past it, no group is measured any more, and a
    group the table lacks costs what `rlflow.measure.costmodel.fallback` estimates from its size instead (the same estimate for
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
        self._gauge: Gauge | None = None
        self.deadline: float | None = None
        self._fallback = None  # rlflow.measure.costmodel.fallback.Fallback, made when a deadline is first set
        self._unmeasured: dict[str, float] = {}  # group key -> the estimate it got when time had run out
        self._seen: dict[str, str] = {}  # group key -> table | measured | estimated | failed, while a deadline is set
        # seconds of the last group measurements (for predicting the next); an estimating subclass "measures" each
        # look-up of a group its table lacks, so an unbounded list grew with every look-up (#49)
        self._durations: deque[float] = deque(maxlen=RECENT_DURATIONS)
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
        self.path = self.cache_dir / table_file_name(self.key)
        live.add(self)

    # ------------------------------------------------------------------------------------------------ public
    def graph_cost(self, graph: Graph) -> float:
        """Estimated end-to-end latency of `graph` in milliseconds."""
        return float(sum(self._costs(graph, self.groups(graph))))

    def graph_costs(self, graphs: Sequence[Graph]) -> list[float]:
        """`graph_cost` of each graph, the groups that set them apart (those not in all of them) priced first: under a
        deadline a cold table's time then goes to what ranks the graphs, not to the groups they share (priced alike
        whether measured or estimated)."""
        grouped = [self.groups(graph) for graph in graphs]
        shared = set.intersection(*({group.key for group in groups} for groups in grouped)) if grouped else set()
        for graph, groups in zip(graphs, grouped):
            self._costs(graph, [group for group in groups if group.key not in shared])
        return [float(sum(self._costs(graph, groups))) for graph, groups in zip(graphs, grouped)]

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
            from rlflow.measure.costmodel.fallback import Fallback

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

    def _costs(self, graph: Graph, groups: list[Group]) -> list[float]:
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
        recent = sorted(self._durations)
        typical = recent[len(recent) // 2] if recent else 0.0
        return time.monotonic() + typical > self.deadline

    # -------------------------------------------------------------------------------------------- partition
    def groups(self, graph: Graph) -> list[Group]:
        """The fusion groups of `graph`, in node order (static nodes belong to no group; see `groups.partition`)."""
        return partition(graph)

    # ------------------------------------------------------------------------------------------ measurement
    def _group_cost(self, graph: Graph, group: Group) -> float:
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

    def _note(self, group: Group, origin: str, cost: float | None) -> None:
        """Records where a group's cost came from (for `coverage`) and shows it to the fallback estimate; only while
        a deadline is set, so that an unlimited search pays nothing for it."""
        if self.deadline is None or group.key in self._seen:
            return
        self._seen[group.key] = origin
        if cost is not None:
            self._fallback.learn(group.key, group, cost)

    def _measure_group(self, graph: Graph, group: Group) -> float:
        model = isolated_model(graph, group)
        optimized = self._optimized(model)
        canon = ("o:" + optimized_key(optimized)) if optimized is not None else group.key
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
        """Milliseconds of an isolated group (`isolated_model`) beyond the call overhead and its boundary reorders:
        what the table stores for it (`optimized`: `_optimized(model)`).

        A group that runs in less than `group_timing.REPLICA_TARGET_S` is timed as independent copies in one model
        (as many as bring one run to that time, at most `group_timing.MAX_REPLICAS`), and the time is divided among
        them: the per-call overhead and its noise are then paid once for all the copies.
        """
        copies = replicas(model, self.settings)
        copied = replicated(model, copies)
        probe = probe_model(max(len(copied.graph.input), 1), max(len(copied.graph.output), 1))
        seconds = time_beyond(copied, probe, self.settings, self.gauge) / copies
        boundary = self._boundary_reorders(optimized) if optimized is not None else 0.0
        return max(seconds * 1e3 - boundary, _FLOOR_MS)

    @property
    def gauge(self) -> Gauge:
        """The slowdown gauge of this cost model's measurements, calibrated before its first one."""
        if self._gauge is None:
            self._gauge = Gauge()
            self._gauge.calibrate(self.settings)
        return self._gauge

    def cached_key(self, graph: Graph, group: Group) -> str | None:
        """The cost key the table holds for one group of `graph` (found through onnxruntime's optimised form where
        the group itself was never met, as `_measure_group` finds it), or None where no cost is cached for it."""
        canon = self.table["groups"].get(group.key)
        if canon is None:
            optimized = self._optimized(isolated_model(graph, group))
            canon = ("o:" + optimized_key(optimized)) if optimized is not None else group.key
        return canon if canon in self.table["costs"] else None

    def remeasure(self, graph: Graph, group: Group, times: int = 1) -> list[float]:
        """`times` fresh measurements of one group of `graph`, each as the table would store it, leaving the table
        as it is (see `rlflow.measure.costmodel.audit`)."""
        model = isolated_model(graph, group)
        optimized = self._optimized(model)
        return [self._time_isolated(model, optimized) for _ in range(times)]

    def set_cost(self, key: str, cost: float) -> None:
        """Overwrites the table's cost `key` (saved with the table): `rlflow costmodel audit --refresh` puts entries
        measured again on an idle machine in place of those a busy one wrote."""
        if key not in self.table["costs"]:
            raise KeyError(f"no cost {key!r} in the table")
        with self._lock:
            self.table["costs"][key] = max(float(cost), _FLOOR_MS)
            self._new += 1

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
            seconds = time_beyond(reorder_probe(shape), probe_model(1, 1), basic, self.gauge)
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

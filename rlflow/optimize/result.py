"""What `rlflow optimize` hands back: the output model, the decision and why, and every figure the report prints."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from rlflow.graph.core import Graph
from rlflow.graph.model_file import ONNXRUNTIME_OPS_IN_ONNX_DOMAIN, save_model
from rlflow.measure.timing import Comparison, Ratio
from rlflow.measure.verify import Verification


@dataclass
class Result:
    """Everything `rlflow optimize` reports, plus the model to write.

    Attributes:
        graph: the output graph (the input's graph when nothing was kept).
        rewritten: whether the output differs from the input.
        reason: why the output is what it is.
        applied: the rewrites applied, in order (`rule@node`).
        comparison: interleaved input-vs-output measurement (ratios[1] is the speedup; exactly 1 when unchanged).
        verification: the rewritten model checked against the input (None when no rewrite was found).
        gate: the final measurement's speedup of the rewritten model over the input, which decided whether it was
            kept (None when no verified rewrite reached it); kept or not, it stays on record here.
        not_reached: what the search's time limit left undone, one sentence each (a cost table only partly measured,
            rollouts or expansions not made, candidates not measured); empty when the search finished its work.
        cost_table: where the search's cost-model group costs came from (`CostModel.coverage`; None for a search
            without a cost model).
        memory: bytes of the weights, the bytes of weights predicted to be held at the peak before the start
            (`check_fits`), and the process's peak resident set seen at the end (ru_maxrss: mapped pages count).
        rejected: the search's rewrites when they were not kept (they did not verify, or the gate refused them).
        search_stop: why the search ended ("time limit", "no rewrite is measurably faster", ...): with rewrites kept,
            whether it had finished or its limit cut it short.
        search_steps: the search's steps where it records them (greedy: rule, location, speedup measured, nodes).
        precision: with `--precision`, what was lowered and why (`PrecisionOutcome.as_dict`): layers per rule, the
            error budget and the samples it was measured on, the errors and logit metrics, weight bytes before and
            after, and each layer's measured error and gain per rule.
        padding: with `--padding`, the declared mask, how many attentions read the rows' lengths (or why none), and
            the row lengths of the padded batches verified (`PaddingOutcome.as_dict`).
        profiles: with several shape profiles, one dict each (shapes, weight, label, input_ms, and output_ms and
            speedup when the final measurement ran); `speedup` is then their weighted geometric mean.
    """

    graph: Graph
    rewritten: bool
    reason: str
    applied: list[str]
    comparison: Comparison
    verification: Verification | None
    op_counts_before: dict[str, int]
    op_counts_after: dict[str, int]
    seconds: float
    search_seconds: float
    candidates_measured: int
    candidates_estimated: int
    settings: dict
    source: str | None = None
    gate: Ratio | None = None
    candidates_unmeasured: int = 0
    not_reached: list[str] = field(default_factory=list)
    cost_table: dict | None = None
    profiles: list[dict] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    candidates_dropped: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)
    search_stop: str = ""
    search_steps: list[dict] = field(default_factory=list)
    precision: dict | None = None
    padding: dict | None = None
    output_model: onnx.ModelProto | None = field(default=None, repr=False)

    @property
    def speedup(self) -> Ratio:
        return self.comparison.ratios[1]

    @property
    def outcome(self) -> str:
        """`reason` in a word or two, for tables: `rewritten`; `gate rejected` (a verified rewrite not measurably
        faster); `not verified`; or, when the search handed back the input, `out of time` (it left candidates it would
        have measured unmeasured) or `nothing found`."""
        if self.rewritten:
            return "rewritten"
        if self.gate is not None:
            return "gate rejected"
        if self.verification is not None:
            return "not verified"
        return "out of time" if self.candidates_unmeasured else "nothing found"

    @property
    def runs_on(self) -> str:
        """Which runtimes can run the output (`runtimes`)."""
        return runtimes(self.graph)

    def save(self, path: str | os.PathLike) -> Path:
        """Writes the output model atomically."""
        return save_model(self.output_model, path)

    def as_dict(self) -> dict:
        return {
            "source": self.source,
            "rewritten": self.rewritten,
            "reason": self.reason,
            "outcome": self.outcome,
            "applied": self.applied,
            "speedup": self.speedup.as_dict(),
            "latency_ms": {"before": self.comparison.timings[0].as_dict(), "after": self.comparison.timings[1].as_dict()},
            "measurement": {k: v for k, v in self.comparison.as_dict().items() if k not in ("timings", "ratios")},
            "verification": self.verification.as_dict() if self.verification else None,
            "gate": self.gate.as_dict() if self.gate else None,
            "op_counts": {"before": self.op_counts_before, "after": self.op_counts_after},
            "runs_on": self.runs_on,
            "seconds": {"total": self.seconds, "search": self.search_seconds},
            "candidates_measured": self.candidates_measured,
            "candidates_estimated": self.candidates_estimated,
            "candidates_unmeasured": self.candidates_unmeasured,
            "not_reached": self.not_reached,
            "search": {"stop_reason": self.search_stop, "steps": self.search_steps},
            "cost_table": self.cost_table,
            "profiles": self.profiles,
            "rejected": self.rejected,
            "candidates_dropped": self.candidates_dropped,
            "memory": self.memory,
            "settings": self.settings,
            "precision": self.precision,
        }


def runtimes(graph: Graph) -> str:
    """Which runtimes can run `graph`: onnxruntime only when it holds operators of other domains than ONNX's own
    (onnxruntime's contrib operators, named), else any ONNX runtime."""
    contrib = [n for n in graph.gs.nodes if (n.domain or "") not in ("", "ai.onnx")
               or n.op in ONNXRUNTIME_OPS_IN_ONNX_DOMAIN]
    if not contrib:
        return "any ONNX runtime (standard operators only)"
    domains = sorted({n.domain or "onnxruntime's default-domain" for n in contrib})
    return f"onnxruntime only ({', '.join(domains)} operators: {', '.join(sorted({n.op for n in contrib}))})"

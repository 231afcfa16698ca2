"""`rlflow optimize --precision`: the exact search's graph, verified exactly, then layers dropped to lower precision
within an error budget (`rlflow.search.precision`), checked on the user's data or on random inputs.

The exact part keeps its own check (the pipeline's, at the float32 tolerance and every verification shape), so the
precision part's check is the error on the samples alone: its rules bake no shape, and the budget is stated for that
data.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import onnx

from rlflow.errors import InputError
from rlflow.graph.core import Graph
from rlflow.measure.accuracy import ErrorReport, Evaluator, Samples, random_samples
from rlflow.measure.memory import weight_bytes
from rlflow.measure.session import PROVIDERS, SessionSettings
from rlflow.measure.verify import Verification
from rlflow.rewrites import PRECISION_RULES, Rule
from rlflow.rewrites.precision import PrecisionRule
from rlflow.search.candidates import SearchResult
from rlflow.search.half import half_search
from rlflow.search.precision import PrecisionSearch, precision_search

PRECISIONS = ("int4", "int8", "fp16", "bf16")
"""What `--precision` offers: int4 (int4 and int8 layers, each where it pays), int8 (int8 layers only), and fp16 or
bf16 (nodes computed in half precision, the rest float32)."""

HALF = ("fp16", "bf16")
"""The precisions whose nodes compute in half (`rlflow.search.half`), not weights stored in fewer bits."""

QUANTIZED_OPS = frozenset({"MatMulNBits", "DynamicQuantizeMatMul", "MatMulInteger", "MatMulIntegerToFloat",
                           "QLinearMatMul", "QLinearConv", "ConvInteger", "DequantizeLinear", "GatherBlockQuantized",
                           "QAttention", "QGemm"})
"""Operators of a graph already in low precision: the report names them, and the search leaves them as they are."""

DEFAULT_MAX_ERROR = {"int8": 0.02, "int4": 0.10, "fp16": 0.01, "bf16": 0.05}
"""The relative error norm of each output allowed when `--max-error` is not given."""

_OFFERED = {"int4": ("int4", "int8"), "int8": ("int8",), "fp16": ("fp16",), "bf16": ("bf16",)}

LOCKS_WEIGHTS = frozenset({"attention-pack-qkv", "gemm-activation-fusion"})
"""Exact rules left out of the search before a precision step: they move a weight into an operator no precision
rule lowers (the packed `Attention`, `FusedGemm`), so on an encoder they kept half its weight bytes in float32."""


def exact_rules(rules: Sequence[Rule], precision: str | None) -> list[Rule]:
    """The exact search's rules: all of `rules`, less LOCKS_WEIGHTS before an integer precision step."""
    return [r for r in rules if precision in (None, *HALF) or r.name not in LOCKS_WEIGHTS]


def check_precision(precision: str | None, max_error: float | None, data, ops: str = "all") -> None:
    """Raises InputError, naming the option, for values no run could use."""
    if precision is None:
        if max_error is not None or data is not None:
            raise InputError("--max-error and --data bound a reduced precision: give --precision too")
        return
    if precision not in PRECISIONS:
        raise InputError(f"unknown precision '{precision}': choose from {', '.join(PRECISIONS)}")
    if max_error is not None and not max_error > 0:
        raise InputError("--max-error takes a relative error norm above 0 (0.05 for 5%)")
    if ops == "standard":
        raise InputError("--precision writes onnxruntime's quantized operators, which --ops standard leaves out")


def precision_rules(precision: str, provider: str) -> list[PrecisionRule]:
    """The rules `--precision` offers on `provider`: its own and the higher precisions below float32.

    Raises InputError for bf16 on the CPU provider, which has no bfloat16 kernel for MatMul or Add (onnxruntime
    1.31); fp16 there runs, and its gate measures whether it pays."""
    if precision == "bf16" and provider != PROVIDERS["cuda"]:
        raise InputError("--precision bf16 needs the CUDA provider: onnxruntime's CPU provider has no bfloat16 "
                         "kernels for MatMul or Add (use fp16, int8 or int4 on the CPU)")
    return [r for r in PRECISION_RULES if r.precision in _OFFERED[precision]
            and (provider != PROVIDERS["cuda"] or r.cuda)]


@dataclass
class PrecisionOutcome:
    """What the precision step did, for the report."""

    precision: str
    budget: float
    budget_given: bool
    samples: str
    random_inputs: bool
    search: PrecisionSearch
    bytes_before: int
    bytes_after: int
    exact_kept: bool
    exact_note: str = ""
    already: dict | None = None
    """Operators of the input already in low precision, counted (`QUANTIZED_OPS`)."""

    def as_dict(self) -> dict:
        error: ErrorReport | None = self.search.error
        return {"precision": self.precision, "max_error": self.budget,
                "max_error_source": "given" if self.budget_given else "default",
                "samples": self.samples, "random_inputs": self.random_inputs,
                "layers": self.search.counts(), "threshold": self.search.threshold,
                "stop_reason": self.search.stop_reason, "least_error": self.search.least_error,
                "evaluations": self.search.evaluations, "seconds": self.search.seconds,
                "error": error.as_dict() if error else None,
                "weight_bytes": {"before": self.bytes_before, "after": self.bytes_after},
                "exact_kept": self.exact_kept, "exact_note": self.exact_note, "already": self.already or {},
                "per_layer": [{"node": layer.node, "shape": list(layer.shape), "chosen": layer.chosen,
                               "variants": {name: {k: v[k] for k in ("error", "gain_ms", "bytes")}
                                            for name, v in layer.variants.items()}}
                              for layer in self.search.layers]}


def lower_precision(graph: Graph, given: onnx.ModelProto, search: SearchResult, exact: Verification | None,
                    settings: SessionSettings, *, precision: str, max_error: float | None, samples: Samples | None,
                    rules: Sequence[PrecisionRule], seed: int, progress: bool = False
                    ) -> tuple[SearchResult, Verification | None, PrecisionOutcome]:
    """The exact search's result with layers lowered on top: the search result to gate (its graph and every rewrite
    applied), the check of what it hands back (the lowered model's on `samples`, the user's data or random inputs
    where None; else `exact`, the exact graph's own check, where that verified), and what happened."""
    samples = samples if samples is not None else random_samples(given, graph.input_shapes, seed)
    budget = max_error if max_error is not None else DEFAULT_MAX_ERROR[precision]
    exact_kept = exact is not None and exact.ok
    base = search.graph if exact_kept else graph
    note = ("" if exact is None or exact_kept else
            f"the exact rewrites were dropped: they do not verify ({exact.message})")
    evaluator = Evaluator(given, samples, settings, budget)
    found = (half_search(base, evaluator, settings, rules, budget, progress=progress) if precision in HALF else
             precision_search(base, evaluator, settings, rules, budget, progress=progress))
    outcome = PrecisionOutcome(precision, budget, max_error is not None, samples.source, samples.random, found,
                               weight_bytes(graph), weight_bytes(found.graph), exact_kept, note,
                               {op: n for op, n in graph.op_counts().items() if op in QUANTIZED_OPS})
    applied = (list(search.applied) if exact_kept else []) + found.applied
    result = replace(search, graph=found.graph, applied=applied,
                     stop_reason=f"{search.stop_reason}; precision: {found.stop_reason}")
    if not found.applied:
        return result, exact if exact_kept else None, outcome
    report = found.error
    within = report.max_error <= budget
    verification = Verification(within, report.checks, (), [{k: list(v.shape) for k, v in samples.feeds[0].items()}],
                                settings.opt_level, "" if within else f"error {report.max_error:.3g} > {budget:.3g}",
                                {"samples": samples.source, "max_error": budget})
    return result, verification, outcome

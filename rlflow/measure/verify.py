"""Numerical equivalence of two models on random inputs: the gate every rewritten model passes before it is written."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np
import onnx

from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings, create_session, run_session

FLOAT32_TOLERANCE = 1e-4
HALF_TOLERANCE = 1e-2


def default_tolerance(dtype: np.dtype) -> float:
    """Relative-norm tolerance by element type: 1e-4 for float32/64, 1e-2 for float16/bfloat16, 0 for the rest."""
    dtype = np.dtype(dtype)
    if dtype.kind != "f" and str(dtype) != "bfloat16":
        return 0.0
    return HALF_TOLERANCE if dtype.itemsize <= 2 else FLOAT32_TOLERANCE


@dataclass
class OutputCheck:
    """The worst error seen on one output over all seeds and shapes.  `rel_norm` (||out - ref|| / ||ref||) is what
    the tolerance bounds; `max_rel` is the largest per-element relative error, which is large wherever a reference
    element is near zero, so it says little alone."""

    name: str
    max_abs: float
    max_rel: float
    rel_norm: float
    tolerance: float
    ok: bool


@dataclass
class Verification:
    """Whether two models agree, with the errors per output and the settings used."""

    ok: bool
    outputs: list[OutputCheck]
    seeds: tuple[int, ...]
    shapes: list[dict]
    opt_level: str
    message: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def max_rel_norm(self) -> float:
        return max((o.rel_norm for o in self.outputs), default=0.0)

    def as_dict(self) -> dict:
        return asdict(self)


def verify(reference: onnx.ModelProto, candidate: onnx.ModelProto, *, seeds: Sequence[int] = (0, 1, 2),
           shapes: Sequence[Mapping[str, Sequence[int]] | None] = (None,),
           fallback: Mapping[str, Sequence[int]] | None = None, tolerance: float | None = None,
           opt_level: str = "disable", share_weights: bool = False,
           candidate_provider: str = "CPUExecutionProvider") -> Verification:
    """Runs both models on the same random inputs and compares every output.

    Args:
        reference: the model whose outputs are the truth.
        candidate: the model to check; it must have the same input and output names.
        seeds: one set of random inputs per seed.
        shapes: input shapes to try (None: the models' static shapes, dynamic dimensions set to 1). Give a second set
            for models with dynamic dimensions, so that a shape baked into the candidate is caught.
        fallback: shapes tried in place of a set of `shapes`, after the first, at which the reference itself cannot
            run: a set that changes apart dimensions the model binds together (a decode step's cache length and the
            total length its mask spans) says nothing about the candidate.  Where the fallback fails too, or there is
            none, the set is skipped; `extra["skipped_shapes"]` lists what was.  The first set must run.
        tolerance: relative-norm tolerance for every float output (default: by element type, see default_tolerance).
        opt_level: onnxruntime optimisation level for both sessions; `disable` checks the rewrite itself, not
            onnxruntime's own fusions.
        share_weights: the sessions share the weights mapped from their file (`SessionSettings.share_weights`).
        candidate_provider: where the candidate runs (the reference runs on the CPU): on CUDA, a check of what the
            device's kernels compute, which the CPU's may not (`rlflow.bench.method_rows.device_errors`).
    """
    settings = SessionSettings(opt_level=opt_level, share_weights=share_weights)
    ref_session = create_session(reference, settings)
    cand_session = create_session(candidate, replace(settings, provider=candidate_provider))
    ref_names = [o.name for o in ref_session.get_outputs()]
    cand_names = {o.name for o in cand_session.get_outputs()}
    missing = [n for n in ref_names if n not in cand_names]
    if missing:
        return Verification(False, [], tuple(seeds), [dict(s or {}) for s in shapes], opt_level,
                            f"candidate lacks output(s) {', '.join(missing)}")
    worst: dict[str, OutputCheck] = {}
    used, skipped = [], []
    for index, shape in enumerate(shapes):
        first = _first_reference_run(ref_session, ref_names, reference, seeds[0], shape, fallback, index == 0)
        if first is None:
            skipped.append(dict(shape or {}))
            continue
        shape, feeds, expected = first
        used.append(dict(shape or {}))
        for seed in seeds:
            if seed != seeds[0]:
                feeds = random_inputs(reference, seed, shape)
                expected = run_session(ref_session, ref_names, feeds)
            try:
                actual = run_session(cand_session, ref_names, feeds)
            except Exception as exc:  # noqa: BLE001 - a candidate that fails to run simply does not verify
                return Verification(False, [], tuple(seeds), used, opt_level,
                                    f"candidate fails to run: {str(exc).strip().splitlines()[0][:300]}")
            for name, a, b in zip(ref_names, expected, actual):
                check = compare_arrays(name, np.asarray(a), np.asarray(b), tolerance)
                if name not in worst or worse(check, worst[name]):
                    worst[name] = check
    checks = [worst[n] for n in ref_names]
    bad = [c for c in checks if not c.ok]
    message = "" if not bad else "; ".join(
        f"{c.name}: relative error {c.rel_norm:.2e} > {c.tolerance:.0e}" for c in bad)
    return Verification(not bad, checks, tuple(seeds), used, opt_level, message,
                        {"skipped_shapes": skipped} if skipped else {})


def _first_reference_run(session, names: list[str], reference: onnx.ModelProto, seed: int, shape: Mapping | None,
                         fallback: Mapping | None, required: bool) -> tuple[Mapping | None, dict, list] | None:
    """The shapes the reference runs at with `seed`'s inputs, `shape` else `fallback`, those inputs and its outputs
    there; None where it runs at neither.  A `required` set (the first) that fails is the reference's own failure,
    and raises."""
    for attempt in (shape,) if required or fallback is None else (shape, fallback):
        try:
            feeds = random_inputs(reference, seed, attempt)
            return attempt, feeds, run_session(session, names, feeds)
        except Exception:  # noqa: BLE001 - where the reference cannot run, these shapes check nothing
            if required:
                raise
    return None


def compare_arrays(name: str, expected: np.ndarray, actual: np.ndarray, tolerance: float | None = None) -> OutputCheck:
    """Errors of `actual` against `expected`; shapes must agree and NaNs must sit in the same places."""
    tol = default_tolerance(expected.dtype) if tolerance is None else tolerance
    if expected.shape != actual.shape:
        return OutputCheck(name, float("inf"), float("inf"), float("inf"), tol, False)
    if expected.dtype.kind not in "fc" and str(expected.dtype) != "bfloat16":
        equal = bool(np.array_equal(expected, actual))
        return OutputCheck(name, 0.0 if equal else float("inf"), 0.0 if equal else float("inf"),
                           0.0 if equal else float("inf"), 0.0, equal)
    e = expected.astype(np.float64)
    a = actual.astype(np.float64)
    nan_e, nan_a = np.isnan(e), np.isnan(a)
    if not np.array_equal(nan_e, nan_a):
        return OutputCheck(name, float("inf"), float("inf"), float("inf"), tol, False)
    e, a = np.where(nan_e, 0.0, e), np.where(nan_a, 0.0, a)
    diff = np.abs(e - a)
    if e.size == 0:
        return OutputCheck(name, 0.0, 0.0, 0.0, tol, True)
    max_abs = float(diff.max())
    max_rel = float((diff / np.maximum(np.abs(e), 1e-6)).max())
    norm = float(np.linalg.norm(e))
    rel_norm = float(np.linalg.norm(e - a) / max(norm, 1e-12 * np.sqrt(e.size)))
    if not np.isfinite(rel_norm):
        rel_norm = float("inf")
    return OutputCheck(name, max_abs, max_rel, rel_norm, tol, rel_norm <= tol)


def worse(a: OutputCheck, b: OutputCheck) -> bool:
    """Whether check `a` of an output is the one to report over `b`: failing where `b` holds, or further off."""
    return (not a.ok and b.ok) or a.rel_norm > b.rel_norm

"""How far a reduced-precision model strays from the model it came from, on the user's data or on random inputs.

`--max-error` bounds the relative error norm of each output, ||out - ref|| / ||ref|| over every sample at once, the
measure `verify` bounds for exact rewrites.  For a language model's logits, what a user feels is different, so the
report adds next-token agreement (argmax equal), the KL divergence of the candidate's next-token distribution from the
input's, and, where the inputs hold the tokens the logits predict, the next-token loss of both models on them.
"""
from __future__ import annotations

import os
import zipfile
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx

from rlflow.errors import InputError
from rlflow.measure.inputs import input_specs, random_inputs
from rlflow.measure.session import SessionSettings, create_session, run_session
from rlflow.measure.verify import OutputCheck, compare_arrays

RANDOM_SAMPLES = 4
"""Random-input samples the error is measured on when no data is given."""

TOKEN_INPUT = "input_ids"


@dataclass
class Samples:
    """The feeds the error is measured on, one dict per run, and where they came from."""

    feeds: list[dict[str, np.ndarray]]
    source: str
    """`data FILE (N samples)` or `random inputs (N samples)`: the report says which."""
    random: bool


def load_data(path: str | os.PathLike, model: onnx.ModelProto) -> Samples:
    """The samples of an npz file of arrays named after the model's inputs, first axis = samples.

    An array of the input's own rank is a batch of samples, fed one at a time at batch 1 (the first axis is the
    model's batch); an array of one more rank holds whole feeds, one per entry.

    Raises:
        InputError: the file is unreadable, or its names, dtypes, ranks, fixed dimensions or sample counts do not fit
            the model; one line saying which.
    """
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise InputError(f"--data {path}: cannot read it as an .npz file ({str(exc).splitlines()[0][:200]})") from None
    specs = input_specs(model)
    missing, extra = sorted(set(specs) - set(arrays)), sorted(set(arrays) - set(specs))
    if missing or extra:
        said = [f"lacks the model's input(s) {', '.join(missing)}"] if missing else []
        said += [f"has array(s) {', '.join(extra)} the model does not take"] if extra else []
        raise InputError(f"--data {path}: {' and '.join(said)} (inputs: {', '.join(specs)})")
    dims = {vi.name: vi.type.tensor_type.shape.dim for vi in model.graph.input if vi.name in specs}
    counts = set()
    feeds_per_input = {}
    for name, (dtype, _) in specs.items():
        array, rank = arrays[name], len(dims[name])
        if array.dtype != np.dtype(dtype):
            raise InputError(f"--data {path}: '{name}' is {array.dtype}, the model takes {np.dtype(dtype)}")
        if array.ndim not in (rank, rank + 1) or array.ndim == 0 or array.shape[0] == 0:
            raise InputError(f"--data {path}: '{name}' has shape {list(array.shape)}; the model's input has rank "
                             f"{rank}: give [samples, ...] of rank {rank} or {rank + 1}, with at least one sample")
        per_sample = [array[i:i + 1] for i in range(len(array))] if array.ndim == rank else list(array)
        for k, dim in enumerate(dims[name]):
            if dim.HasField("dim_value") and dim.dim_value > 0 and per_sample[0].shape[k] != dim.dim_value:
                raise InputError(f"--data {path}: '{name}' has {per_sample[0].shape[k]} at axis {k} of a sample, "
                                 f"the model fixes {dim.dim_value}")
        counts.add(len(per_sample))
        feeds_per_input[name] = per_sample
    if len(counts) > 1:
        raise InputError(f"--data {path}: the arrays hold different numbers of samples ({sorted(counts)})")
    n = counts.pop()
    feeds = [{name: np.ascontiguousarray(per[i]) for name, per in feeds_per_input.items()} for i in range(n)]
    return Samples(feeds, f"data {os.fspath(path)} ({n} samples)", random=False)


def random_samples(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]], seed: int,
                   count: int = RANDOM_SAMPLES) -> Samples:
    """`count` random-input feeds at `shapes` (`random_inputs`: token ids within the embedding table)."""
    feeds = [random_inputs(model, seed + i, shapes) for i in range(count)]
    return Samples(feeds, f"random inputs ({count} samples)", random=True)


@dataclass
class ErrorReport:
    """A candidate's error against the reference on the samples."""

    checks: list[OutputCheck]
    """Per float output, over all samples at once; `rel_norm` is what the budget bounds (its `tolerance`)."""
    source: str
    logits: dict = field(default_factory=dict)
    """For a logits output: `agreement` (next-token argmax equal), `kl` (nats, reference to candidate) and, where
    the inputs hold the tokens, `loss_reference` and `loss_candidate` (next-token cross-entropy, nats)."""

    @property
    def max_error(self) -> float:
        return max((c.rel_norm for c in self.checks), default=0.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "max_error": self.max_error}


class Evaluator:
    """The reference's outputs on the samples, computed once; `error(candidate)` runs a candidate on the same and
    compares it within `budget`."""

    def __init__(self, reference: onnx.ModelProto, samples: Samples, settings: SessionSettings,
                 budget: float) -> None:
        self.samples, self.settings, self.budget = samples, settings, budget
        session = create_session(reference, settings)
        self.names = [o.name for o in session.get_outputs()]
        self.reference = _run_all(session, self.names, samples.feeds)

    def error(self, candidate: onnx.ModelProto) -> ErrorReport:
        """The candidate's errors; a candidate that cannot run raises ProviderError (`create_session`)."""
        outputs = _run_all(create_session(candidate, self.settings), self.names, self.samples.feeds)
        checks, logits = [], {}
        for name, ref, cand in zip(self.names, self.reference, outputs):
            if ref[0].dtype.kind != "f":
                continue
            checks.append(compare_arrays(name, _joined(ref), _joined(cand), self.budget))
            if _is_logits(name, ref[0]):
                logits = _logit_metrics(ref, cand, [f.get(TOKEN_INPUT) for f in self.samples.feeds])
        return ErrorReport(checks, self.samples.source, logits)


def _joined(arrays: list[np.ndarray]) -> np.ndarray:
    """The samples' arrays as one (flattened where their shapes differ)."""
    if len({a.shape for a in arrays}) == 1:
        return np.stack(arrays)
    return np.concatenate([a.ravel() for a in arrays])


def _run_all(session, names: list[str], feeds: list[dict]) -> list[list[np.ndarray]]:
    """Per output, its array on each sample."""
    runs = [run_session(session, names, f) for f in feeds]
    return [[run[i] for run in runs] for i in range(len(names))]


def _is_logits(name: str, array: np.ndarray) -> bool:
    return "logits" in name.lower() and array.ndim >= 2 and array.shape[-1] >= 2


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _logit_metrics(ref: list[np.ndarray], cand: list[np.ndarray], tokens: list[np.ndarray | None]) -> dict:
    agree, kl, count = 0.0, 0.0, 0
    losses = {"loss_reference": [], "loss_candidate": []}
    for r, c, ids in zip(ref, cand, tokens):
        lr, lc = _log_softmax(r), _log_softmax(c)
        agree += float(np.sum(r.argmax(-1) == c.argmax(-1)))
        kl += float(np.sum(np.exp(lr) * (lr - lc)))
        count += int(np.prod(r.shape[:-1]))
        if ids is not None and r.ndim == 3 and ids.shape == r.shape[:2] and ids.shape[1] > 1:
            target = ids[:, 1:, None]
            losses["loss_reference"].append(-np.take_along_axis(lr[:, :-1], target, -1).mean())
            losses["loss_candidate"].append(-np.take_along_axis(lc[:, :-1], target, -1).mean())
    metrics = {"agreement": agree / max(count, 1), "kl": kl / max(count, 1)}
    if losses["loss_reference"]:
        metrics.update({k: float(np.mean(v)) for k, v in losses.items()})
    return metrics

"""Timing through onnxruntime: single-model statistics and interleaved comparisons with bootstrap intervals.

On small shared machines run-to-run drift is larger than most rewrite effects, so models are compared interleaved in
one process (round-robin, order shuffled every round) and a speedup is claimed only when the interval excludes 1.
"""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

import numpy as np
import onnx

from rlflow.errors import ProviderError
from rlflow.measure.bootstrap import Ratio, bootstrap_ratio
from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings, cannot_run, create_session, ort_feeds, session_source

MIN_ROUND_SECONDS = 0.01
"""Each model runs enough times per round to take at least this long, so clock resolution never matters."""

WARMUP_RUNS = 5
"""Untimed runs of each fresh session before its rounds (`compare`'s default)."""

SWITCH_RUNS = 3
"""Untimed runs that start a model's round, where it runs often enough in a round for them to cost at most a quarter
more (`round_runs`): the first runs after the other models ran are slower by varying amounts (the caches hold the
other models' weights), and on a model of about a millisecond they alone made a screening's interval several times
wider than the gain it was screening for (docs/measurement.md)."""

RUN_PROBES = 5
"""Runs in a row at most that set a round's length by the fastest of them (`warm_run_seconds`)."""

MIN_ROUNDS = 3
"""Rounds a block of `compare` runs before its deadline may stop it, so that every block says something."""

PACE_STEPS = ("export", "session", "run")
"""What a `Pace` times: `Graph.to_model`, building a `Runner`, one warm run."""

PROBE_MARGIN = 1.5
"""Factor on the session build a `probe` times: a lone session builds faster than the same one beside a batch's others
(BERT-base, 2 vCPU: 2.6-3.3 s probed, 3.3-4.4 s in batches of 2 to 7), and a session is the longest step that
nothing can interrupt."""


@dataclass
class Timing:
    """Latency statistics of one model, with the settings they were measured under (milliseconds)."""

    label: str
    median_ms: float
    iqr_ms: float
    min_ms: float
    mean_ms: float
    samples: int
    warmup: int
    settings: dict

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Comparison:
    """An interleaved comparison: `timings[i]` per model, `ratios[i]` = speedup of model i over model 0."""

    timings: list[Timing]
    ratios: list[Ratio]
    rounds: int
    runs_per_round: int
    warmup: int
    settings: dict
    seed: int
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Pace:
    """The slowest export, session build and run seen so far by one search, to predict what still fits in its time.

    A comparison stops only between its steps, and on a large model one step takes seconds (a BERT-base session
    3-5 s), so a deadline holds only if no step starts that cannot finish before it.  The slowest observation is used,
    so that predictions err towards stopping early.

    Attributes:
        seconds: step -> slowest seconds seen; steps are "export" (`Graph.to_model`), "session" (a `Runner` built) and
            "run" (one inference, warm).
    """

    seconds: dict[str, float] = field(default_factory=dict)

    def observe(self, step: str, seconds: float) -> None:
        self.seconds[step] = max(seconds, self.seconds.get(step, 0.0))

    @contextmanager
    def timed(self, step: str):
        """Observes how long the body of the `with` takes."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.observe(step, time.perf_counter() - start)

    @property
    def known(self) -> bool:
        """Whether every step has been seen (until then, predictions count the unseen steps as free)."""
        return all(step in self.seconds for step in PACE_STEPS)

    def round_seconds(self, models: int) -> float:
        """One round of `compare` over `models` models (each runs for at least MIN_ROUND_SECONDS)."""
        run = self.seconds.get("run", 0.0)
        return models * sum(round_runs(run)) * run if run > 0 else 0.0

    def block_seconds(self, models: int, *, exports: int = 0, warmup: int = WARMUP_RUNS,
                      rounds: int = MIN_ROUNDS) -> float:
        """The least one block of `compare` over `models` models takes, after `exports` of them are exported first."""
        s = self.seconds
        per_model = s.get("session", 0.0) + (warmup + 1) * s.get("run", 0.0)  # + 1: calibrating the runs per round
        return exports * s.get("export", 0.0) + models * per_model + rounds * self.round_seconds(models)


def probe(model: onnx.ModelProto, settings: SessionSettings, pace: Pace, *, seed: int = 0,
          shapes: Mapping[str, Sequence[int]] | None = None) -> None:
    """Builds one session of `model` and runs it, recording in `pace` how long that took.

    A measurement bound by a deadline needs these figures before it starts.  The session's time is recorded with
    PROBE_MARGIN; the first run is not counted: it allocates what later runs reuse.

    Raises:
        ProviderError: onnxruntime cannot build or run the model.
    """
    start = time.perf_counter()
    runner = Runner(model, settings, random_inputs(model, seed, shapes))
    pace.observe("session", PROBE_MARGIN * (time.perf_counter() - start))
    try:
        runner.run()
        pace.observe("run", runner.time(1))
    except Exception as exc:  # noqa: BLE001 - as in `compare`: builds but cannot run
        raise _cannot_run(settings, exc) from None


def _cannot_run(settings: SessionSettings, exc: Exception) -> ProviderError:
    return ProviderError(f"onnxruntime ({settings.provider}) cannot run a model: "
                         f"{str(exc).strip().splitlines()[0][:300]}")


class Runner:
    """One model ready to run repeatedly: a session and its inputs, bound to the device on CUDA.

    On CUDA, inputs and outputs are bound to the GPU once (IOBinding) so host-device copies stay out of timings, and
    each run ends with a synchronisation before the clock is read.  With CUDA graph capture (`settings.cuda_graph`)
    the outputs are preallocated too (`buffers`): a replayed graph writes where it wrote when captured.
    """

    def __init__(self, model: onnx.ModelProto | bytes, settings: SessionSettings, feeds: Mapping[str, np.ndarray]):
        self.settings = settings
        self.session = create_session(model, settings)
        names = {i.name for i in self.session.get_inputs()}
        self.feeds = ort_feeds({k: v for k, v in feeds.items() if k in names})
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.buffers = None
        self._binding = None
        if settings.provider == "CUDAExecutionProvider":
            import onnxruntime as ort

            binding = self.session.io_binding()
            self._inputs = {name: ort.OrtValue.ortvalue_from_numpy(value.numpy(), "cuda", 0)
                            for name, value in self.feeds.items()}  # kept: a captured graph reads these addresses
            for name, value in self._inputs.items():
                binding.bind_ortvalue_input(name, value)
            if settings.cuda_graph:
                self.buffers = {name: ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, "cuda", 0)
                                for name, shape, dtype in output_specs(self.session)}
                for name, value in self.buffers.items():
                    binding.bind_ortvalue_output(name, value)
            else:
                for name in self.outputs:
                    binding.bind_output(name, "cuda")
            self._binding = binding

    def run(self) -> None:
        if self._binding is not None:
            self.session.run_with_iobinding(self._binding)
            self._binding.synchronize_outputs()
        else:
            self.session.run_with_ort_values(self.outputs, self.feeds)

    def time(self, runs: int) -> float:
        """Seconds per run, averaged over `runs` back-to-back runs."""
        start = time.perf_counter()
        for _ in range(runs):
            self.run()
        return (time.perf_counter() - start) / runs


ONNX_TO_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
                 "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
                 "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}
"""numpy types of the onnxruntime output types a preallocated buffer can hold."""


def output_specs(session) -> list[tuple[str, list[int], type]]:
    """Each output's name, fixed shape and numpy type, for buffers allocated before the first run.

    Raises:
        ProviderError: an output's shape is not fixed in the model (export it with static shapes, or give
            --input-shape), or its type has no buffer here.
    """
    specs = []
    for output in session.get_outputs():
        if not all(isinstance(d, int) and d >= 0 for d in output.shape):
            raise ProviderError(f"CUDA graph capture needs every output's shape fixed; {output.name} is "
                                f"{list(output.shape)}")
        if output.type not in ONNX_TO_NUMPY:
            raise ProviderError(f"CUDA graph capture: output {output.name} has type {output.type}, which rlflow "
                                "cannot preallocate")
        specs.append((output.name, list(output.shape), ONNX_TO_NUMPY[output.type]))
    return specs


def _stats(label: str, seconds: Sequence[float], warmup: int, settings: SessionSettings) -> Timing:
    ms = np.asarray(seconds) * 1e3
    q1, q3 = np.percentile(ms, [25, 75])
    return Timing(label, float(np.median(ms)), float(q3 - q1), float(ms.min()), float(ms.mean()), len(ms), warmup,
                  settings.as_dict())


def time_model(model: onnx.ModelProto, settings: SessionSettings | None = None, *, warmup: int = 5,
               repeats: int = 30, seed: int = 0, shapes: Mapping[str, Sequence[int]] | None = None,
               label: str = "model") -> Timing:
    """Latency of one model: `warmup` untimed runs, then `repeats` timed runs."""
    settings = settings or SessionSettings()
    runner = Runner(model, settings, random_inputs(model, seed, shapes))
    for _ in range(warmup):
        runner.run()
    return _stats(label, [runner.time(1) for _ in range(repeats)], warmup, settings)


CHECK_SECONDS = 2.0
"""Timed runs of `check_and_time` stop after this long (once it has 3): its latency is a report's, not a comparison."""


def check_and_time(model: onnx.ModelProto, settings: SessionSettings, *, seed: int = 0,
                   shapes: Mapping[str, Sequence[int]] | None = None, warmup: int = 2, repeats: int = 10,
                   label: str = "input", pace: Pace | None = None) -> Timing:
    """Latency of a model that must run: one session both checks it and times it.

    `rlflow optimize` needs both of the input, the check before searching and the latency when the input is kept; a
    second session would cost as much again (GPT-2 small: 4 s to build, 0.5 s a run).  Timed runs stop at `repeats`,
    or after CHECK_SECONDS once there are 3.  `pace`, when given, records the session's build and its median run
    (what the final measurement plans with).

    Raises:
        ProviderError: onnxruntime cannot build a session for the model, or cannot run it (some models pass session
            creation and fail only when run: a Reshape to an impossible shape, say).
    """
    start = time.perf_counter()
    runner = Runner(model, settings, random_inputs(model, seed, shapes))
    if pace is not None:
        pace.observe("session", time.perf_counter() - start)
    try:
        for _ in range(max(1, warmup)):
            runner.run()
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises several private exception types
        raise cannot_run(settings, exc) from None
    samples: list[float] = []
    began = time.perf_counter()
    while len(samples) < repeats and (len(samples) < 3 or time.perf_counter() - began < CHECK_SECONDS):
        samples.append(runner.time(1))
    if pace is not None:
        pace.observe("run", float(np.median(samples)))
    return _stats(label, samples, max(1, warmup), settings)


def compare(models: Sequence[onnx.ModelProto], settings: SessionSettings | None = None, *, rounds: int = 30,
            warmup: int = WARMUP_RUNS, seed: int = 0, shapes: Mapping[str, Sequence[int]] | None = None,
            labels: Sequence[str] | None = None, confidence: float = 0.95, deadline: float | None = None,
            blocks: int | None = None, pace: Pace | None = None,
            feeds: Sequence[Mapping[str, np.ndarray]] | None = None) -> Comparison:
    """Interleaved comparison of models on the same inputs.

    Every round runs each model (in a freshly shuffled order) enough times to take MIN_ROUND_SECONDS; the speedup of
    model i over model 0 is the ratio of their times within a round, summarised by the median over rounds with a
    bootstrap interval.

    Rounds are grouped in blocks, and every block builds fresh sessions in a shuffled order: two sessions of the very
    same model differ by a percent or two for as long as they live (memory placement), so a single pair of sessions
    gives confidently wrong intervals.  Every second block builds and warms them in the reverse of the order before,
    so that each model's mean place in that order is the same: sessions built and warmed later tended to run faster
    (with the same order in every trial, a copy of the input read faster than the input in up to 19 of 20,
    docs/measurement.md).  The interval resamples blocks, then rounds within them, and so covers that as far
    as the blocks show it: one block (a search's screening) shows nothing of it, and on a decode step a model was
    called faster or slower than itself far more often than 5% even with three blocks (placebo trials).

    Args:
        models: model 0 is the baseline.
        rounds: timed rounds in all (fewer are run if `deadline` passes first, at least MIN_ROUNDS).
        deadline: a time.monotonic() value after which no new round starts.
        blocks: session rebuilds (default: one per 6 rounds, at most 5).
        pace: records how long sessions and runs take; with a deadline, a later block or a round past MIN_ROUNDS
            starts only if the pace predicts it ends before the deadline (the first block always runs: plan it with
            `Pace.block_seconds`).
        feeds: one input dict per model, for models whose inputs differ (default: random inputs of model 0 at
            `shapes`, fed to every model).
    """
    if len(models) < 2:
        raise ValueError("compare needs at least two models")
    settings = settings or SessionSettings()
    labels = list(labels or [f"model{i}" for i in range(len(models))])
    blocks = blocks or min(5, max(1, rounds // 6))
    per_block = max(1, rounds // blocks)
    feeds = list(feeds) if feeds is not None else [random_inputs(models[0], seed, shapes)] * len(models)
    sources = [session_source(m) if isinstance(m, onnx.ModelProto) else m for m in models]  # serialized once
    rng = np.random.default_rng(seed)
    times: list[list[float]] = [[] for _ in models]
    block_of_round: list[int] = []
    runs, warm = None, 0
    order = np.arange(len(models))  # the building order of a block's sessions
    for block in range(blocks):
        ahead = pace.block_seconds(len(models), warmup=warmup) if pace is not None else 0.0
        if deadline is not None and block > 0 and _ends_after(deadline, ahead):
            break
        order = rng.permutation(len(models)) if block % 2 == 0 else order[::-1]
        runners: list[Runner | None] = [None] * len(models)
        for i in order:
            start = time.perf_counter()
            runners[i] = Runner(sources[i], settings, feeds[i])
            if pace is not None:
                pace.observe("session", time.perf_counter() - start)
        try:
            for i in order:
                for _ in range(warmup):
                    runners[i].run()
        except Exception as exc:  # noqa: BLE001 - a model that builds but cannot run (bad Reshape...) is not measurable
            raise _cannot_run(settings, exc) from None
        if runs is None:
            runs, warm = round_runs(max(warm_run_seconds(r) for r in runners))
        for done in range(per_block):
            ahead = pace.round_seconds(len(models)) if pace is not None else 0.0
            if deadline is not None and done >= MIN_ROUNDS and _ends_after(deadline, ahead):
                break
            for i in rng.permutation(len(runners)):
                for _ in range(warm):
                    runners[i].run()  # untimed: see SWITCH_RUNS
                times[i].append(runners[i].time(runs))
                if pace is not None:
                    pace.observe("run", times[i][-1])
            block_of_round.append(block)
        del runners
    base = np.asarray(times[0])
    groups = np.asarray(block_of_round)
    ratios = [bootstrap_ratio(base, np.asarray(t), confidence, rng, groups=groups) for t in times]
    timings = [_stats(label, t, warmup, settings) for label, t in zip(labels, times)]
    return Comparison(timings, ratios, len(base), runs, warmup, settings.as_dict(), seed,
                      extra={"blocks": int(groups.max()) + 1 if len(groups) else 0, "untimed_runs_per_round": warm})


def warm_run_seconds(runner: Runner) -> float:
    """One warm run's seconds: the fastest of up to RUN_PROBES runs in a row, fewer once they have taken
    MIN_ROUND_SECONDS (a model that slow runs once a round anyway).  A single run after the other models ran is cold
    (a 0.8 ms model's first run after a switch took 1.5-2 ms): it gave a round half the runs it needs and one untimed
    run instead of SWITCH_RUNS, and a one-block screening of a 1.2-1.3x gain intervals from 0.95 to 1.45
    (docs/measurement.md)."""
    fastest, spent = math.inf, 0.0
    for _ in range(RUN_PROBES):
        seconds = runner.time(1)
        fastest, spent = min(fastest, seconds), spent + seconds
        if spent >= MIN_ROUND_SECONDS:
            break
    return fastest


def round_runs(run_seconds: float) -> tuple[int, int]:
    """A model's timed runs in a round of `compare` (enough to take MIN_ROUND_SECONDS) and the untimed ones before
    them (`SWITCH_RUNS`, at most a quarter of the timed)."""
    runs = max(1, math.ceil(MIN_ROUND_SECONDS / max(run_seconds, 1e-9)))
    return runs, min(SWITCH_RUNS, runs // 4)


def _ends_after(deadline: float, seconds: float) -> bool:
    """Whether work predicted to take `seconds`, started now, would end after `deadline` (0: whether it has passed)."""
    return time.monotonic() + seconds > deadline

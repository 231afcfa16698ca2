"""onnxruntime's CUDA graph capture as a peer configuration: the same model, replayed as one captured CUDA graph.

(`rlflow optimize --cuda-graph` measures its search and its verdict this way; this script weighs the setting itself,
and with `--rewritten` an output of rlflow beside its input, both ways.)

At batch 1 a GPU spends much of a model's time launching kernels; `enable_cuda_graph` captures the whole run once and
replays it with one launch.  It is not a graph rewrite but a session setting every onnxruntime user can turn on, so it
is the configuration rlflow's rewrites must be weighed against on CUDA.  It applies only when every node runs on the
CUDA provider and inputs and outputs stay at fixed device addresses (IOBinding with preallocated buffers).

Each model is measured interleaved against the plain CUDA session (ORT_ENABLE_ALL, IOBinding), sessions rebuilt per
block, and the outputs of the captured replay are compared with the plain session's.

    python gpu/cuda_graph_peer.py models/*.onnx --out build/cuda-graph.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from rlflow.files import write_text_atomic
from rlflow.graph.core import load
from rlflow.measure.bootstrap import bootstrap_ratio
from rlflow.measure.inputs import random_inputs
from rlflow.measure.session import SessionSettings, inference_session, session_options
from rlflow.measure.timing import Runner, round_runs, warm_run_seconds
from rlflow.measure.verify import compare_arrays

PROVIDER = "CUDAExecutionProvider"


def _outputs(runner: Runner, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A runner's outputs: a captured one's from its last replay, a plain one's from one more run."""
    if runner.buffers is not None:
        return {name: value.numpy() for name, value in runner.buffers.items()}
    inputs = {i.name for i in runner.session.get_inputs()}
    values = runner.session.run(runner.outputs, {k: v for k, v in feeds.items() if k in inputs})
    return dict(zip(runner.outputs, values))


CONFIGURATIONS = ("plain", "captured", "rewritten", "rewritten_captured")
"""What `measure` times: the input as a plain CUDA session and captured, and with `rewritten` the same two of it."""


def measure(path: Path, rounds: int, blocks: int, seed: int, rewritten: Path | None = None) -> dict:
    """The captured configuration's speedup over the plain CUDA session, with its largest relative output error.

    With `rewritten` (rlflow's output for the same model), it is timed too, plain and captured, in the same rounds: a
    rewrite that saves launches is worth less once one launch replays the whole graph, and this says how much.
    """
    settings = SessionSettings(provider=PROVIDER)
    captured = SessionSettings(provider=PROVIDER, cuda_graph=True)
    models = [load(path).to_model(static=True)]
    if rewritten is not None:
        models.append(load(rewritten).to_model(static=True))
    feeds = random_inputs(models[0], seed)
    plain = inference_session(models[0], session_options(settings), [PROVIDER])
    names = [o.name for o in plain.get_outputs()]
    expected = dict(zip(names, plain.run(names, feeds)))
    del plain
    configurations = CONFIGURATIONS[: 2 * len(models)]
    rng = np.random.default_rng(seed)
    times: list[list[float]] = [[] for _ in configurations]
    block_of_round: list[int] = []
    errors = dict.fromkeys(configurations[1:], 0.0)
    runs = None
    for block in range(blocks):
        runners = [runner for model in models
                   for runner in (Runner(model, settings, feeds), Runner(model, captured, feeds))]
        for runner in runners:
            for _ in range(5):
                runner.run()
        for label, runner in zip(configurations[1:], runners[1:]):
            outputs = _outputs(runner, feeds)
            errors[label] = max([errors[label], *(compare_arrays(name, want, outputs[name]).rel_norm
                                                  for name, want in expected.items())])
        if runs is None:
            runs, _ = round_runs(max(warm_run_seconds(r) for r in runners))  # its rounds start timed at once
        for _ in range(max(1, rounds // blocks)):
            for i in rng.permutation(len(runners)):
                times[i].append(runners[i].time(runs))
            block_of_round.append(block)
        del runners
    series = {label: np.asarray(t) for label, t in zip(configurations, times)}
    groups = np.asarray(block_of_round)

    def ratio(baseline: str, candidate: str):
        return bootstrap_ratio(series[baseline], series[candidate], rng=rng, groups=groups)

    capture = ratio("plain", "captured")
    row = {"model": path.stem, "status": "ok", "plain_ms": float(np.median(series["plain"]) * 1e3),
           "cuda_graph_ms": float(np.median(series["captured"]) * 1e3), "speedup": capture.median,
           "speedup_low": capture.low, "speedup_high": capture.high, "max_rel_error": errors["captured"],
           "rounds": len(times[0]), "runs_per_round": runs, "blocks": blocks}
    if rewritten is not None:
        row["rewritten"] = str(rewritten)
        row["rewritten_ms"] = float(np.median(series["rewritten"]) * 1e3)
        row["rewritten_captured_ms"] = float(np.median(series["rewritten_captured"]) * 1e3)
        for key, (baseline, candidate) in {"rewrite_plain": ("plain", "rewritten"),
                                           "rewrite_captured": ("captured", "rewritten_captured"),
                                           "both": ("plain", "rewritten_captured")}.items():
            r = ratio(baseline, candidate)
            row[key] = {"median": r.median, "low": r.low, "high": r.high}
        row["rewritten_max_rel_error"] = max(errors["rewritten"], errors["rewritten_captured"])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python gpu/cuda_graph_peer.py", description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="JSON results, rewritten after every model")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rewritten", metavar="SUFFIX", default=None,
                        help="also time MODEL's rewritten version, the file beside it named STEM + SUFFIX "
                             "(e.g. .rlflow.onnx), plain and captured; models without one are timed alone")
    args = parser.parse_args(argv)
    rows = []
    for path in args.models:
        start = time.monotonic()
        try:
            beside = path.with_name(path.stem + args.rewritten) if args.rewritten else None
            row = measure(path, args.rounds, args.blocks, args.seed,
                          beside if beside is not None and beside.exists() else None)
        except Exception as exc:  # noqa: BLE001 - a model the capture cannot take is a row, not the end of the run
            row = {"model": path.stem, "status": "not applicable",
                   "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
        row["seconds"] = time.monotonic() - start
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_text_atomic(args.out, json.dumps({"provider": PROVIDER, "opt_level": "all", "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

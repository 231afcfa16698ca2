"""How finely can the bench tell two graphs apart on Gemma-3-270M's decode step?  The input measured against itself
(a clone, three times) and against an identical copy written by a peer (onnxoptimizer, which changes nothing here),
as `rlflow bench` measures a row: batch 1, past 128 and 448, 12 interleaved rounds, 1 thread.  Writes
self-compare.json beside this file.

    python benchmarks/decoders/gemma3/self_compare.py models/gemma3-270m-decode-p128-dynamo.onnx
"""
import datetime
import json
import sys
import tempfile
from pathlib import Path

from rlflow.bench.method_rows import measure_outputs
from rlflow.bench.peers import run_peer
from rlflow.bench.run import _settings_for
from rlflow.files import cache_dir
from rlflow.graph.core import Graph
from rlflow.measure.session import SessionSettings
from rlflow.measure.shape_profiles import load_profiled, parse_profile

PROFILES = ("batch=1;past_sequence=128", "batch=1;past_sequence=448")


def main(path: str) -> dict:
    graph = load_profiled(Path(path), [parse_profile(p) for p in PROFILES], {"batch": 1}, None)
    settings = _settings_for(graph, SessionSettings(threads=1))
    out = {"model": Path(path).stem, "date": datetime.date.today().isoformat(), "profiles": PROFILES, "rounds": 12,
           "share_weights": settings.share_weights, "comparisons": []}
    cache_dir("peers").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir("peers")) as folder:
        _, copy = run_peer("onnxoptimizer", graph.to_model(static=False), folder)
        others = [("itself", graph.clone()), ("onnxoptimizer's identical copy", Graph.from_model(
            copy, dict(graph.input_shapes))), ("itself", graph.clone()), ("itself", graph.clone())]
        for seed, (label, other) in enumerate(others):
            (measured,) = measure_outputs(graph, [other], settings, 12, seed)
            row = {"against": label, "seed": seed, "speedup": measured.ratio.median, "low": measured.ratio.low,
                   "high": measured.ratio.high, "per_profile": measured.per_profile}
            out["comparisons"].append(row)
            print(f"{label} (seed {seed}): {row['speedup']:.3f} [{row['low']:.3f}, {row['high']:.3f}]", flush=True)
    results = Path(__file__).resolve().parents[3] / "docs" / "results" / "decoders" / "gemma3"
    (results / "self-compare.json").write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main(sys.argv[1])

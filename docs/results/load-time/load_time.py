"""How long `rlflow optimize` takes to load a model before its search starts, and the memory that takes.

Each model is loaded as `rlflow optimize` loads it (`rlflow.optimize.pipeline.load_input`: the file read and checked,
its weights put aside, the graph built), in a fresh process, several times; the figures are each process's wall time
for the load, its system time (page faults: the copies of the weights) and its peak resident memory.

    python docs/results/load-time/load_time.py MODEL.onnx... [--repeats 3] [--out FOLDER]    # load.json, load.md
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import json, resource, sys, time
from rlflow.optimize.pipeline import load_input
start = time.monotonic()
load_input(sys.argv[1], None)
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"seconds": time.monotonic() - start, "system_seconds": usage.ru_stime,
                  "peak_gib": usage.ru_maxrss / 2**20}))
"""


def load_once(model: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(model)], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout:
        commit += " with uncommitted changes"
    rows = []
    for model in args.models:
        runs = [load_once(model) for _ in range(args.repeats)]
        rows.append({"model": model.stem, "file_gib": model.stat().st_size / 2**30, "runs": runs,
                     **{key: statistics.median(r[key] for r in runs) for key in runs[0]}})
        print(f"{model.stem}: {rows[-1]['seconds']:.1f} s, {rows[-1]['peak_gib']:.2f} GiB", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load.json").write_text(json.dumps({"commit": commit, "repeats": args.repeats, "rows": rows}, indent=1))
    lines = [f"Loading as `rlflow optimize` does (commit {commit}; median of {args.repeats} fresh processes):", "",
             "| model | file | load | of it, system time | peak resident |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['file_gib']:.2f} GiB | {r['seconds']:.1f} s | {r['system_seconds']:.1f} s "
              f"| {r['peak_gib']:.2f} GiB |" for r in rows]
    (args.out / "load.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

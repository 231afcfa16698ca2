"""The shipped agent as a user first meets it: `rlflow optimize` at its defaults on a machine whose cost table has never
seen the model, then again (the table now holds what the first run measured), with greedy after them for reference.

Each model gets its own fresh `RLFLOW_CACHE`, so every first run starts from an empty table, as on a new install.

    python benchmarks/cold-table/cold_table.py MODEL.onnx... --out FOLDER [--agent-runs 2] [--greedy]
    python benchmarks/cold-table/cold_table.py --summarize FOLDER          # FOLDER/table.md from its JSON files
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

RUN_NAMES = {1: "cold table", 2: "second", 3: "third"}


def optimize(model: Path, cache: Path, report: Path, method: str | None) -> None:
    command = [sys.executable, "-m", "rlflow.cli", "optimize", str(model), "-o", str(cache / "out.onnx"),
               "--provider", "cpu", "--quiet", "--json", str(report)]
    if method:
        command += ["--method", method]
    subprocess.run(command, env={**os.environ, "RLFLOW_CACHE": str(cache)}, check=True, capture_output=True)


def run(models: list[Path], out: Path, agent_runs: int, greedy: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for model in models:
        cache = out / f".cache-{model.stem}"
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()
        for i in range(1, agent_runs + 1):
            optimize(model, cache, out / f"{model.stem}-agent-{i}.json", None)
        if greedy:
            optimize(model, cache, out / f"{model.stem}-greedy-1.json", "greedy")
        shutil.rmtree(cache, ignore_errors=True)
        print(f"{model.stem} done", flush=True)


def summarize(folder: Path) -> str:
    reports = sorted(folder.glob("*-*-*.json"))
    models = sorted({p.stem.rsplit("-", 2)[0] for p in reports})
    lines = ["| model | run | method | speedup [95% interval] | whole run | search | measured end to end | how the "
             "search ended |", "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for model in models:
        for path in sorted(folder.glob(f"{model}-*-*.json"), key=lambda p: (p.stem.rsplit("-", 2)[1], p.stem)):
            method, run_number = path.stem.rsplit("-", 2)[1:]
            report = json.loads(path.read_text())
            speedup = report["speedup"]
            label = RUN_NAMES.get(int(run_number), run_number) if method == "agent" else "after the agent's"
            lines.append(f"| {model} | {label} | {method} | {speedup['median']:.3f} [{speedup['low']:.3f}, "
                         f"{speedup['high']:.3f}] | {report['seconds']['total']:.1f} s | "
                         f"{report['seconds']['search']:.1f} s | {report['candidates_measured']} | "
                         f"{report['search']['stop_reason']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--agent-runs", type=int, default=2)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--summarize", type=Path, metavar="FOLDER")
    args = parser.parse_args()
    if args.summarize:
        (args.summarize / "table.md").write_text(summarize(args.summarize))
        return
    if not args.models or args.out is None:
        parser.error("give MODELS and --out, or --summarize FOLDER")
    run(args.models, args.out, args.agent_runs, args.greedy)
    (args.out / "table.md").write_text(summarize(args.out))


if __name__ == "__main__":
    main()

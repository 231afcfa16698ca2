"""The least an agent search can cost on each held-out model, against a fifth of greedy's search time: the agent's
greedy rollout alone with its end graph measured against the input (`rollouts=1, top_k=1`), the same with 5 rounds
of measurement instead of 15, and the default search.  If even the first two take longer than a fifth of greedy's
time, no policy meets the time target on that model while the search measures what it returns.

    python benchmarks/agent-deploy/search_floor.py --greedy 'docs/results/agent-deploy/planned-250/heldout-*' \
        --out docs/results/agent-deploy/search-floor.md MODEL.onnx...
(one process on the machine, `RLFLOW_CACHE` set to the table the agents were benched with)
"""
from __future__ import annotations

import argparse
import glob
import json
import platform
import time
from pathlib import Path

import onnxruntime

from rlflow.graph.core import load
from rlflow.measure.session import SessionSettings
from rlflow.search.agent import AgentConfig, agent_search, load_agent

CONFIGS = {"one rollout, one candidate": dict(rollouts=1, top_k=1),
           "the same, 5 rounds": dict(rollouts=1, top_k=1, rounds=5),
           "default": {}}


def greedy_seconds(pattern: str) -> dict[str, list[float]]:
    """Greedy's search seconds per model over the bench runs matching `pattern`."""
    seconds: dict[str, list[float]] = {}
    for folder in sorted(glob.glob(pattern)):
        for row in json.loads((Path(folder) / "results.json").read_text())["rows"]:
            if row["method"] == "greedy" and row["status"] == "ok":
                seconds.setdefault(row["model"], []).append(row["search_seconds"])
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--agent", default=None, help="agent checkpoint (default: the shipped one)")
    parser.add_argument("--greedy", required=True, help="glob of bench folders whose greedy rows give its times")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    greedy = greedy_seconds(args.greedy)
    policy = load_agent(args.agent)
    lines = ["# The least an agent search costs, against a fifth of greedy's time", "",
             f"`python benchmarks/agent-deploy/search_floor.py` on {platform.processor() or platform.machine()}, "
             f"CPU, 1 thread, onnxruntime {onnxruntime.__version__}; agent {args.agent or 'shipped'}; greedy's times "
             f"from `{args.greedy}`. Each cell: the agent's search seconds (the policy loaded beforehand) and the "
             "speedup it measured for what it returns.", "",
             "| model | greedy s (fifth) | " + " | ".join(CONFIGS) + " |", "|---|---|" + "---|" * len(CONFIGS)]
    for path in args.models:
        graph = load(path)
        name = Path(path).stem
        cells = []
        for config in CONFIGS.values():
            start = time.monotonic()
            result = agent_search(graph, SessionSettings(), AgentConfig(time_limit=10.0, **config), policy=policy)
            best = result.stop_reason.rsplit("measured: ", 1)[-1] if "measured: " in result.stop_reason else "kept"
            cells.append(f"{time.monotonic() - start:.2f} s, {best.split(' ')[0]}")
        times = greedy.get(name, [])
        fifth = f"{min(times):.1f}-{max(times):.1f} ({min(times) / 5:.2f}-{max(times) / 5:.2f})" if times else "n/a"
        lines.append(f"| {name} | {fifth} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

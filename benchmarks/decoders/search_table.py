"""The table of a folder of `rlflow optimize --json` reports on the decode steps (first-step-limit/ and its reruns):
per step and batch, the output's speedup, the search's time against its limit, the candidates measured and why the
search stopped.

    python benchmarks/decoders/search_table.py docs/results/decoders/first-step-limit-aside
"""
import json
import sys
from pathlib import Path

ORDER = ("smollm2-135m-decode-p128-dynamo", "qwen3-0.6b-l8-decode-p128-dynamo", "smollm2-135m-decode-p128-ts",
         "qwen3-0.6b-l8-decode-p128-ts")


def row(path: Path) -> str:
    report = json.loads(path.read_text())
    step = path.stem.removesuffix("-dynamic-batch")
    batch = "dynamic" if path.stem.endswith("-dynamic-batch") else "1"
    speedup = report["speedup"]
    if report["rewritten"]:
        rules = ", ".join(dict.fromkeys(s["rule"] for s in report["search"]["steps"]))
        output = f"**{speedup['median']:.3f}** [{speedup['low']:.3f}, {speedup['high']:.3f}]: {rules}"
    else:
        output = "input kept"
    search, limit = report["seconds"]["search"], report["settings"]["time_limit"]
    input_ms = "/".join(f"{p['input_ms']:.0f}" for p in report["profiles"])
    return (f"| {step} | {batch} | {output} | {input_ms} ms | {search:.0f} s of {limit:.0f} s | "
            f"{report['candidates_measured']} | {len(report['search']['steps'])} | {report['search']['stop_reason']} |")


def main(folder: Path) -> str:
    paths = sorted(folder.glob("*.json"), key=lambda p: (p.stem.endswith("-dynamic-batch"),
                                                        ORDER.index(p.stem.removesuffix("-dynamic-batch"))))
    lines = ["| decode step, past 128 and 1024 | batch | greedy's output | input at p128/p1024 | search, limit | "
             "candidates | steps | greedy stopped |", "| --- | --- | --- | --- | --- | ---: | ---: | --- |"]
    return "\n".join(lines + [row(p) for p in paths])


if __name__ == "__main__":
    print(main(Path(sys.argv[1])))

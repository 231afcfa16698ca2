"""How long `rlflow optimize` takes as a user runs it: every default, a fresh process per model, wall clock.

The bench's `time s` column times the optimisation inside one long-lived process; a user also pays for starting
Python, importing torch and onnxruntime, loading the agent and writing the output.  This command measures exactly
that, one model after another (never in parallel, so that the machine's other core stays free), and records the exit
status and what the report says (rewritten or kept, speedup) beside each time.

    rlflow wallclock models --out docs/results

writes optimize-wallclock.json and optimize-wallclock.md into --out (atomically, once all models are done).
"""
from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from rlflow.bench.machine import environment
from rlflow.bench.run import find_models
from rlflow.files import write_text_atomic
from rlflow.measure.session import SessionSettings, resolve_provider

LIMIT_SECONDS = 60.0
"""What `rlflow optimize` should take on any zoo model on 2 cores; the table marks times over it."""


def time_optimize(model: Path, workdir: Path, extra_args: list[str]) -> dict:
    """One `rlflow optimize MODEL` run in a fresh process: wall seconds, exit status and the report's outcome."""
    output = workdir / f"{model.stem}.rlflow.onnx"
    report_path = workdir / f"{model.stem}.json"
    command = [sys.executable, "-m", "rlflow.cli", "optimize", str(model), "-o", str(output),
               "--json", str(report_path), "--quiet", *extra_args]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    row = {"model": model.stem, "seconds": seconds, "exit": done.returncode, "rewritten": None, "speedup": None,
           "reason": None, "settings": None}
    if done.returncode == 0 and report_path.exists():
        report = json.loads(report_path.read_text())
        row.update(rewritten=report["rewritten"], speedup=report["speedup"], reason=report.get("reason"),
                   settings=report["settings"])
    else:
        lines = done.stderr.strip().splitlines()
        row["reason"] = lines[-1] if lines else f"exit {done.returncode} with no message"
    return row


def markdown(results: dict) -> str:
    env = results["environment"]
    lines = [
        "# `rlflow optimize` wall time per model",
        "",
        f"Produced by `{results.get('invocation', 'rlflow wallclock')}`.",
        "",
        f"Measured {env['date']} on {env['cpu']} ({env['cores']} cores), {env['provider']}, "
        f"onnxruntime {env['onnxruntime']}, "
        f"rlflow {env['rlflow']}: `{results['command']}` in a fresh process per model, one at a time, every "
        f"default ({' '.join(results['extra_args']) or 'no extra options'}). Wall time includes starting Python, "
        f"the imports, loading the agent, the search, verification, the final interleaved measurement and writing "
        f"the output; more than {LIMIT_SECONDS:.0f} s is marked with ✗.",
        "",
        "| model | exit | wall s | outcome | speedup [95% CI] |",
        "| --- | ---: | ---: | --- | --- |",
    ]
    for row in results["rows"]:
        mark = "" if row["seconds"] < LIMIT_SECONDS else " ✗"
        if row["exit"] != 0:
            outcome, speedup = f"failed: {row['reason']}", ""
        else:
            outcome = "rewritten" if row["rewritten"] else "input kept"
            s = row["speedup"]
            speedup = f"{s['median']:.3f} [{s['low']:.3f}, {s['high']:.3f}]"
        lines.append(f"| {row['model']} | {row['exit']} | {row['seconds']:.1f}{mark} | {outcome} | {speedup} |")
    seconds = [row["seconds"] for row in results["rows"]]
    if seconds:
        lines += ["", f"Slowest {max(seconds):.1f} s, mean {sum(seconds) / len(seconds):.1f} s over "
                      f"{len(seconds)} models; {sum(s >= LIMIT_SECONDS for s in seconds)} over {LIMIT_SECONDS:.0f} s."]
    return "\n".join(lines) + "\n"


def wallclock(models, out: str | Path = Path("docs/results"), optimize_args: str = "",
              invocation: str | None = None) -> dict:
    """`rlflow wallclock`: times `rlflow optimize` on each of `models` (ONNX files or folders of them), with the
    options `optimize_args` (one string, split as a shell does), in a fresh process each, one at a time; writes
    optimize-wallclock.json and optimize-wallclock.md into `out`, prints the table and returns the results.  Every
    row's `exit` says whether its run succeeded.  `invocation` is recorded as the command that produced them
    [default: the `rlflow wallclock` line that does the same].

    Raises:
        RlflowError: a model path that is neither an ONNX file nor a folder of them (before any run).
    """
    models = list(models)
    models_found = find_models(models)
    extra_args = shlex.split(optimize_args)  # quoted values (paths with spaces) stay one argument
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlflow-wallclock-") as workdir:
        for model in tqdm(models_found, desc="optimize", unit="model"):
            rows.append(time_optimize(model, Path(workdir), extra_args))
    settings = SessionSettings(provider=resolve_provider("auto"))  # what `rlflow optimize` picks by default
    invocation = invocation or shlex.join(["rlflow", "wallclock", *map(str, models), "--out", str(out)]
                                          + (["--optimize-args", optimize_args] if optimize_args else []))
    results = {"invocation": invocation, "command": "rlflow optimize MODEL -o OUT --json REPORT --quiet",
               "extra_args": extra_args,
               "environment": environment(settings), "limit_seconds": LIMIT_SECONDS, "rows": rows}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "optimize-wallclock.json", json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    write_text_atomic(out / "optimize-wallclock.md", table)
    print(table)
    return results

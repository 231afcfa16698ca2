"""The lease plan: what the GPU owes the open issues, in the order a lease measures it (issue #79's order).

A lease has 15 device-minutes, starts included, and comes now and then; so each step is one `gpu/measure.sh` run
that fits what is left of a lease after its start and the kit's install, and writes its results where
`docs/results/gpu/plan/STEP/` is committed from. A step whose folder exists is done: the next lease picks up at the
first step that is not (`pending`), and `gpu/kit.py` writes the calls for that one first.

    python gpu/plan.py                      # the pending steps, in order, with their settings
    python gpu/plan.py --rehearse OUT       # every step on this machine's CPU with tiny stand-ins (GPU_PROVIDER=cpu)

The rehearsal runs each step's own settings but with the zoo's tiny stand-ins for its models and short limits, so that
a step that would fail on the device (a missing option, a misspelt model, a step measure.sh lacks) fails here first.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results" / "gpu" / "plan"


@dataclass(frozen=True)
class Step:
    """One measure.sh run: its settings (environment), why, and the device-minutes it is expected to take."""

    name: str
    issue: str
    settings: dict[str, str]
    minutes: float
    """Expected device-minutes, the zoo build included (from the nearest measured run, or a stated guess)."""
    stand_ins: str
    """The zoo's small models the CPU rehearsal runs in place of GPU_ZOO."""

    def environment(self) -> str:
        """The settings as the `VAR=value ...` prefix of `bash gpu/remote.sh measure`."""
        return " ".join(f"{k}={shlex.quote(v)}" for k, v in self.settings.items())

    def done(self, results: Path = RESULTS) -> bool:
        return (results / self.name).is_dir()


CAPTURED = {"GPU_STEPS": "bench", "GPU_CUDA_GRAPH": "1", "GPU_METHODS": "agent,greedy,taso",
            "GPU_TIME_LIMIT": "default", "GPU_ROUNDS": "5", "GPU_BENCH_ARGS": "--control"}
"""The classic architectures' bench: every method and peer captured, the control row beside. Each method at its
default limit, which `optimize` raises until its planned candidates fit at the paces it measures on the device (the
old row's fixed 10 s measured no candidate in 13 of 24 searches); three models a step."""

CLASSIC = ("squeezenet-1.1 mobilenet-v2 resnet-18", "nasrnn resnet-50 resnext-50-32x4d",
           "inception-v3 densenet-121 nasnet-a-mobile", "gpt2-small vit-b-16 bert-base")


def _padded(model: str, stand_in: str) -> Step:
    return Step(f"padded-decode-{model.split('-')[0]}", "#79 1",
                {"GPU_STEPS": "optimize bench", "GPU_CUDA_GRAPH": "1", "GPU_METHODS": "agent,greedy",
                 "GPU_TIME_LIMIT": "30", "GPU_ROUNDS": "5", "GPU_OPTIMIZE_ARGS": "--padding attention_mask=right",
                 "GPU_ZOO": model}, 7, stand_in)


PLAN: tuple[Step, ...] = (
    _padded("qwen3-0.6b-l8-decode-p128-dynamo-fp16", "qwen3-tiny-decode-p16-dynamo"),
    _padded("smollm2-135m-decode-p128-dynamo-fp16", "qwen3-tiny-decode-p16-dynamo"),
    *(Step(f"classic-captured-{i}", "#79 2", {**CAPTURED, "GPU_ZOO": zoo}, 11, "squeezenet-1.1-tiny")
      for i, zoo in enumerate(CLASSIC, 1)),
    Step("precision-fp16", "#77 GPU", {"GPU_STEPS": "precision", "GPU_PRECISION": "fp16", "GPU_ROUNDS": "10",
                                       "GPU_ZOO": "smollm2-135m-decode-p128-dynamo bert-l4-h256-s128-dynamo"}, 8,
         "bert-l2-h128-s16-ts"),
    Step("precision-int4", "#77 GPU", {"GPU_STEPS": "precision", "GPU_PRECISION": "int4", "GPU_ROUNDS": "10",
                                       "GPU_ZOO": "smollm2-135m-decode-p128-dynamo qwen3-0.6b-l8-decode-p128-dynamo"},
         8, "bert-l2-h128-s16-ts"),
    *(Step(f"classic-plain-{i}", "#79 2", {"GPU_STEPS": "bench", "GPU_METHODS": "agent,taso",
                                           "GPU_TIME_LIMIT": "default", "GPU_ROUNDS": "5", "GPU_ZOO": zoo}, 11,
           "resnet-18-tiny") for i, zoo in enumerate((" ".join(CLASSIC[:2]), " ".join(CLASSIC[2:])), 1)),
    Step("held-out-encoders", "#79 4", {**CAPTURED, "GPU_BENCH_ARGS": "",
                                        "GPU_ZOO": "bert-l4-h256-s16-ts electra-small-s16-dynamo"}, 9,
         "bert-l2-h128-s16-ts"),
    Step("decode-fp32-plain", "#79 5",
         {"GPU_STEPS": "bench", "GPU_METHODS": "agent,greedy", "GPU_TIME_LIMIT": "30", "GPU_ROUNDS": "5",
          "GPU_BENCH_ARGS": "--fix-dim batch=1 --fix-value attention_mask=1",
          "GPU_ZOO": "smollm2-135m-decode-p128-dynamo qwen3-0.6b-l8-prefill-s128-dynamo"}, 11,
         "qwen3-tiny-decode-p16-ts"),
)
"""Issue #79's order: padded decode steps, the classic architectures captured, precision (#77), the classic
architectures plain (what docs/results/gpu/classic-estimate/ predicts: the estimate prices uncaptured launches), the
held-out encoders, then fp32, plain and prefill steps; the full-depth models come after these. A step's
minutes are a guess where no run of its kind was timed; the padded steps' come from docs/results/gpu/h200-1130/ (its
two decode steps: kit a minute, zoo build 1.8 minutes, bench 8.1), the held-out encoders' from the same run."""

LEASE_MINUTES = 15
START_MINUTES = 3.5
"""A lease's start and the kit's transfer and install, from the leases so far (2-4 minutes)."""


def pending(results: Path = RESULTS) -> list[Step]:
    """The steps not measured yet, in plan order."""
    return [step for step in PLAN if not step.done(results)]


def rehearse(out: Path, python: str = sys.executable) -> list[tuple[str, int, float]]:
    """Runs every step of the plan with GPU_PROVIDER=cpu on its stand-ins, each into `out/STEP`; returns each step's
    exit status and seconds, and writes them to `out/README.md`. The kit's copy of the tree is made as
    `gpu/remote.sh install` makes it."""
    src = out / "src"
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "rlflow", "gpu",
                             "models"], cwd=ROOT, check=True, capture_output=True).stdout.split(b"\0")
    for name in filter(None, listed):
        target = src / name.decode()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes((ROOT / name.decode()).read_bytes())
    statuses = []
    for step in PLAN:
        start = time.monotonic()
        kit = out / step.name
        (kit / "site").mkdir(parents=True, exist_ok=True)
        (kit / "src").unlink(missing_ok=True)
        (kit / "src").symlink_to(src.resolve())
        env = {**os.environ, **step.settings, "RLFLOW_KIT": str(kit), "PYTHON": python, "GPU_PROVIDER": "cpu",
               "GPU_ZOO": step.stand_ins, "GPU_TIME_LIMIT": "3", "GPU_ROUNDS": "3",
               "PYTHONPATH": str(src), "RLFLOW_CACHE": str(out / "cache")}
        with open(out / f"{step.name}.log", "w") as log:
            run = subprocess.run(["bash", str(ROOT / "gpu" / "measure.sh")], env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
        statuses.append((step.name, run.returncode if (kit / "results" / "DONE").exists() else 1,
                         time.monotonic() - start))
        print(f"{step.name}: exit {statuses[-1][1]}, log {out / (step.name + '.log')}", flush=True)
    (out / "README.md").write_text(summary(out, statuses))
    return statuses


def summary(out: Path, statuses: list[tuple[str, int, float]]) -> str:
    """The rehearsal as markdown: each step's exit status, minutes, failures and the results files it wrote."""
    lines = ["| step | issue | exit | minutes | failed | results written |", "| --- | --- | --- | --- | --- | --- |"]
    issues = {step.name: step.issue for step in PLAN}
    for name, code, seconds in statuses:
        results = out / name / "results"
        failed = (results / "FAILED").read_text().strip().replace("\n", "; ") if (results / "FAILED").exists() else ""
        written = sorted(str(p.relative_to(results)) for p in results.rglob("*") if p.is_file()
                         and p.name not in ("DONE", "FAILED", "environment.json", "zoo-build.txt"))
        lines.append(f"| {name} | {issues[name]} | {code} | {seconds / 60:.1f} | {failed} | {', '.join(written)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python gpu/plan.py", description=__doc__.splitlines()[0])
    parser.add_argument("--rehearse", type=Path, metavar="OUT", help="run every step on the CPU with stand-ins")
    args = parser.parse_args(argv)
    if args.rehearse:
        return int(any(code for _, code, _ in rehearse(args.rehearse)))
    for step in pending():
        print(f"{step.name} ({step.issue}, about {step.minutes:g} device-minutes): {step.environment()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

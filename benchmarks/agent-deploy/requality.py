"""The world-model quality figures of finished runs, recomputed from their checkpoints: the figures a run reported
(`rlflow.train.worldmodel.quality.quality` after its last iteration) plus any added since, such as `reward_spearman_moved`.

The checkpoint holds V, M, the location scorer and the replay as they stood after the last iteration; the quality
figures were taken before that iteration's greedy evaluation added its episodes, so those are left out, and the
recomputed Pearson and Spearman must equal the reported ones (the script says so, or fails).

    python benchmarks/agent-deploy/requality.py build/quiet-table/wm0/worldmodel.pt ... --out FILE.md
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from rlflow.errors import RlflowError
from rlflow.train.worldmodel.quality import MOVED
from rlflow.train.worldmodel.rerun_quality import checkpoint_quality


def requality(path: Path) -> dict:
    """`checkpoint_quality` of the run at `path`, refused where it does not reproduce the reported figures."""
    figures, reported = checkpoint_quality(path)
    for key in ("reward_pearson", "reward_spearman"):
        if not math.isclose(figures[key], reported[key], rel_tol=1e-4, abs_tol=1e-6):
            raise SystemExit(f"{path}: recomputed {key} {figures[key]:.4f} differs from the reported "
                             f"{reported[key]:.4f}; the checkpoint is not the run's last iteration")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoints", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    lines = ["# World-model reward quality, recomputed from the checkpoints", "",
             f"`python benchmarks/agent-deploy/requality.py {' '.join(map(str, args.checkpoints))} --out {args.out}`",
             "", f"Held-out transitions; *moved*: those whose real reward is at least {MOVED}% of the estimated "
             "runtime in size (`rlflow.train.worldmodel.quality.MOVED`). Pearson and Spearman equal the runs' reports.", "",
             "| run | transitions | Pearson | Spearman | moved | Spearman over the moved | real reward exactly 0 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for path in args.checkpoints:
        try:
            q = requality(path)
        except RlflowError as exc:  # a missing or foreign checkpoint: one line, nothing written
            raise SystemExit(f"error: {exc}") from None
        lines.append(f"| {path.parent.name} | {q['heldout_transitions']} | {q['reward_pearson']:.3f} | "
                     f"{q['reward_spearman']:.3f} | {q['moved_transitions']} | {q['reward_spearman_moved']:.3f} | "
                     f"{q['zero_transitions']} |")
        print(lines[-1], flush=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

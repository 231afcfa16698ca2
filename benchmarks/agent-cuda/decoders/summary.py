"""The CUDA agent trained with the decoders' training cut: learning figures per seed and each agent's graphs on the
held-out models scored by the CUDA estimate, beside the shipped agent's, fuse-everything and TASO-style search.
Reads seedN/worldmodel.json, estimate-seedN/ and estimate-shipped/ here, and for the encoders the shipped agent's
own run (../estimate/, ../estimate-seed2/); writes summary.md.

    python benchmarks/agent-cuda/decoders/summary.py

Some of its inputs left the tree with issue #80 (git keeps them): `git checkout c3883d3 --
docs/results/agent-cuda/estimate docs/results/agent-cuda/estimate-seed2` brings them back.
"""
import json
import statistics
from pathlib import Path

here = Path(__file__).resolve().parents[3] / "docs" / "results" / "agent-cuda" / "decoders"
seeds = sorted(p for p in here.glob("seed[0-9]") if (p / "worldmodel.json").exists())


def load(folder: Path) -> dict:
    """model -> {method: (estimated speedup, seconds)} of a bench-estimate run (empty when it is missing)."""
    path = folder / "results.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {r["model"]: {m: (v["estimated_speedup"], v["seconds"]) for m, v in r["methods"].items()} for r in rows}


def spread(values) -> str:
    return f"median {statistics.median(values):.3f}, range {min(values):.3f}-{max(values):.3f}" if values else "-"


def geomean(values) -> float:
    return statistics.geometric_mean(values) if values else float("nan")


lines = ["# The CUDA agent trained with the decoders (issue #49): learning and held-out figures", "",
         "Written by `python benchmarks/agent-cuda/decoders/summary.py`. Rewards and scores are the CUDA cost model's "
         "(the shipped H100 table and its fitted estimate): nothing here was measured on a GPU.", "",
         "## Learning, held-out transitions of the CUDA rewards", "",
         "| seed | reward Pearson | Spearman | real steps | final greedy return | Pearson and Spearman >= 0.8 | minutes |",
         "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
pearson, spearman = [], []
for seed in seeds:
    r = json.loads((seed / "worldmodel.json").read_text())
    pearson.append(r["reward_pearson"])
    spearman.append(r["reward_spearman"])
    ok = r["reward_pearson"] >= 0.8 and r["reward_spearman"] >= 0.8
    lines.append(f"| {seed.name[4:]} | {r['reward_pearson']:.3f} | {r['reward_spearman']:.3f} | "
                 f"{r['real_steps_worldmodel']} | {r['curve'][-1]['eval_mean_return']:.1f} | {'yes' if ok else 'no'} | "
                 f"{r['wall_seconds'] / 60:.0f} |")
lines += ["", f"Pearson {spread(pearson)}; Spearman {spread(spearman)} over {len(seeds)} seeds. Sample efficiency "
          "against PPO on the same rewards: [sample-efficiency.md](sample-efficiency.md).", ""]

shipped, peers = load(here / "estimate-shipped"), load(here.parent / "estimate")
old_agent = load(here.parent / "estimate-seed2")  # the shipped cuda.pt's own run on the encoders
runs = {seed.name[4:]: load(here / f"estimate-seed{seed.name[4:]}") for seed in seeds}
models = list(shipped) + [m for m in peers if m not in shipped]
lines += ["## Held-out models, scored by the CUDA estimate (estimated speedup over the input; search seconds)", "",
          "Decoders: Qwen3 (q/k norms) is a family never trained on; SmolLM2 at its full 30 layers is the trained "
          "family at a depth never seen. Encoders: the ten held-out exports of [../README.md](../README.md), their "
          "fuse-everything, TASO-style and shipped-agent figures from that run (../estimate/, ../estimate-seed2/).", "",
          "| model | fuse-everything | TASO-style, 30 s | shipped cuda.pt | " + " | ".join(f"seed {s}" for s in runs)
          + " |", "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in runs) + " |"]


def cell(entry) -> str:
    return f"{entry[0]:.3f} ({entry[1]:.0f} s)" if entry else "-"


totals = {"fuse": {}, "taso": {}, "shipped": {}, **{s: {} for s in runs}}
for model in models:
    source = shipped.get(model) or peers.get(model, {})
    agent_old = shipped.get(model, {}).get("agent") or old_agent.get(model, {}).get("agent")
    entries = {"fuse": source.get("fuse-everything"), "taso": source.get("taso"), "shipped": agent_old,
               **{s: runs[s].get(model, {}).get("agent") for s in runs}}
    part = "decoders" if model in shipped else "encoders"
    for key, entry in entries.items():
        if entry:
            totals[key].setdefault(part, []).append(entry[0])
    lines.append(f"| {model} | " + " | ".join(cell(entries[k]) for k in entries) + " |")
for part in ("decoders", "encoders"):
    lines.append(f"| **geomean, {part}** | " + " | ".join(
        f"{geomean(totals[k].get(part, [])):.3f}" if totals[k].get(part) else "-" for k in totals) + " |")
(here / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

"""A world-model agent's sample efficiency against the PPO baseline on the same rewards (issue #49's target: the
world-model agent reaches PPO's final return in at most a fifth of PPO's real steps, on at least three seeds of four),
from a run folder's seedN/worldmodel.json curves and ppo/ppo.json, written to its sample-efficiency.md.  Any
provider's run: the CUDA agent's folders here, the CPU agent's ../agent-deploy/decoders/.

    python benchmarks/agent-cuda/sample_efficiency.py [FOLDER]    # default docs/results/agent-cuda/; decoders/ the other

Some of its inputs left the tree with issue #80 (git keeps them): `git checkout c3883d3 --
docs/results/agent-cuda/ppo docs/results/agent-cuda/seed0 docs/results/agent-cuda/seed1
docs/results/agent-cuda/seed2 docs/results/agent-cuda/seed3` brings them back.
"""
import json
import statistics
import sys
from pathlib import Path

from rlflow.train.worldmodel.result import steps_to_reach

DEFAULT = Path(__file__).resolve().parents[2] / "docs" / "results" / "agent-cuda"
here = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else DEFAULT
ppo = json.loads((here / "ppo" / "ppo.json").read_text())
final, steps = ppo["train"]["final_mean_return"], ppo["train"]["real_steps"]
provider = "CUDA" if ppo["config"].get("provider") == "cuda" else "CPU"
rows, held = [], 0
for seed in sorted(here.glob("seed[0-9]")):
    result = json.loads((seed / "worldmodel.json").read_text())
    same = result["registry_version"] == ppo["registry_version"]
    reached = steps_to_reach(result["curve"], final)
    ok = same and reached is not None and reached <= steps / 5
    held += ok
    rows.append(f"| {seed.name} | {result['curve'][-1]['eval_mean_return']:+.2f} | {result['real_steps_worldmodel']} | "
                f"{reached if reached is not None else 'not reached'} | "
                f"{'-' if reached is None else f'{reached / steps:.3f}'} | {'yes' if same else 'NO'} | "
                f"{'holds' if ok else 'no'} |")
finals = [json.loads((s / "worldmodel.json").read_text())["curve"][-1]["eval_mean_return"]
          for s in sorted(here.glob("seed[0-9]"))]
lines = [f"# The {provider} agent's sample efficiency against PPO on the same {provider} rewards", "",
         f"PPO (`ppo/ppo.json`): final mean return {final:+.2f} (its last {3 * len(ppo['config']['models'])} training "
         f"episodes) after {steps} real steps; a fifth of them is {steps / 5:.0f}.", "",
         "| seed | world model's final greedy return | its real steps | real steps to reach PPO's final | "
         "as a share of PPO's | same rule registry | at most a fifth |", "| --- | ---: | ---: | ---: | ---: | --- | --- |",
         *rows, "",
         f"Holds on {held} of {len(rows)} seeds (target: three of four). World model's final greedy return: median "
         f"{statistics.median(finals):+.2f} [{min(finals):+.2f}, {max(finals):+.2f}].",
         "", "PPO's final is the mean return of sampled-action training episodes; the world model's is one greedy "
         "episode per model (as `worldmodel.json`'s `definitions` say)."]
(here / "sample-efficiency.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))

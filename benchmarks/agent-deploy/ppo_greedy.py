"""PPO's return played greedily, one episode per training model, as the world-model agent is evaluated
(`rlflow.train.evaluate.rollout_greedy`): PPO's *final* return is the mean of its last sampled training episodes,
which greedy play need not reach.  Rewards come from the cost table of RLFLOW_CACHE: give the run's own.

    RLFLOW_CACHE=... python benchmarks/agent-deploy/ppo_greedy.py build/quiet-table/ppo/ppo.pt
"""
from __future__ import annotations

import sys

from rlflow.agents.policy import load_checkpoint
from rlflow.env.rewrite_env import RewriteEnv
from rlflow.measure.costmodel.model import CostModel
from rlflow.measure.session import SessionSettings
from rlflow.rewrites import RULES
from rlflow.train.evaluate import rollout_greedy


def main(path: str) -> None:
    policy, payload = load_checkpoint(path)
    policy.eval()
    trained = policy.config
    models = [f"models/{name}.onnx" for name in payload["config"]["models"]]  # its training models, in its order
    settings = SessionSettings(threads=1)
    env = RewriteEnv(models, rules=RULES, cost_model=CostModel(settings), settings=settings,
                     scope=trained.get("scope", "rule"), max_episode_steps=int(trained.get("max_episode_steps", 10)),
                     max_candidates=int(trained.get("max_candidates", 64)))
    returns = [rollout_greedy(policy, env, index)[2] for index in range(len(models))]
    print(" ".join(f"{name} {ret:+.2f}" for name, ret in zip(payload["config"]["models"], returns)))
    print(f"mean {sum(returns) / len(returns):+.2f}")


if __name__ == "__main__":
    main(sys.argv[1])

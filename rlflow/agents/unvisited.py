"""Rollouts that never return to a graph they have visited.

Inverse rules undo each other (matmul-add-to-gemm and gemm-to-matmul-add, skip-layernorm-fusion and -unfuse), so a
greedy policy can spend a whole episode stepping between two graphs.  A rollout that remembers the fingerprints of
the graphs it has visited skips every rewrite that leads back to one and takes the policy's next choice instead.
`RewriteEnv.peek` tells where a rewrite leads without taking the step (no reward is read).  Where an action applies
its rule wherever it matches (`scope="rule"`), every location of the rule leads to the same graph, so a rule whose one
location leads back is skipped at all of them: peeking at each in turn (a rule-wide rewrite apiece) took most of a
held-out ELECTRA's rollout time, twelve to eighteen peeks a step.  Used by `rlflow
optimize`'s agent search and by the world-model trainer's greedy real evaluation, so that training reports the agent
as it is deployed.
"""
from __future__ import annotations

import torch

from rlflow.env.observation import NEG

_INVALID = -1e7
"""Logits at or below this are actions that cannot be taken (policies mark them NEG, -1e8)."""


def choose_unvisited(env, logits: torch.Tensor, seen: set[str], *, greedy: bool, may_terminate: bool = True,
                     temperature: float = 1.0, generator: torch.Generator | None = None) -> int:
    """The policy's action, skipping rewrites that lead to a graph in `seen` (terminate when none is left).

    Args:
        env: a `rlflow.env.rewrite_env.RewriteEnv` at the current graph.
        logits: (C + 1,) the policy's logits over the environment's actions (terminate last); not modified.
        seen: fingerprints of the graphs this episode has visited, the current one included.
        greedy: take the best remaining action, else sample one at `temperature`.
        may_terminate: whether the policy's own terminate is a choice (a sampled rollout that must keep going
            leaves it out); terminate is still returned when no rewrite leads anywhere new.
    """
    logits = logits.clone()
    terminate = env.terminate_action
    if not may_terminate:
        logits[terminate] = NEG
    while True:
        valid = logits > _INVALID
        if not bool(valid.any()):
            return terminate
        if greedy:
            action = int(logits.argmax())
        else:
            probs = torch.softmax(logits / max(temperature, 1e-6), -1) * valid
            action = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
        if action == terminate:
            return action
        child = env.peek(action)
        if child is not None and child not in seen:
            return action
        logits[action] = NEG
        if child is not None and getattr(env, "scope", "match") == "rule":
            candidates = env.candidates  # a copy of the list: read once
            rule = candidates[action].rule
            for other, match in enumerate(candidates):
                if match.rule == rule:
                    logits[other] = NEG


__all__ = ["choose_unvisited"]

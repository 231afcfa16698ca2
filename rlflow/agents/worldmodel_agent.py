"""The world-model agent as `rlflow optimize` runs it: its networks, its checkpoint, and the step it takes on a graph.

V (`GraphVAE`), M (`MDRNN`), the controller (`rlflow.agents.controller.LatentPolicy`) and the location scorer
(`rlflow.worldmodel.location.LocationScorer`), built from an `AgentSpec`; `save_checkpoint` / `load_checkpoint`; and
`Memory`, the state the agent carries through a real episode (V's encoding of the graph, M's memory of the rewrites
applied), which both the actor (`rlflow.agents.actor`) and training's real episodes
(`rlflow.train.worldmodel.episodes`) step.  Nothing here trains: importing this module pulls in no trainer.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from rlflow.agents.checkpoint import load_checkpoint_payload, save_checkpoint_atomic

CHECKPOINT_FORMAT = 2


@dataclass
class AgentSpec:
    """What shapes the agent's networks and optimisers.  The world-model trainer's `Config` extends it (its docstring
    says what each field means), so a checkpoint's config always holds a spec."""

    latent_size: int = 32
    hidden: int = 64
    rounds: int = 3
    vae_lr: float = 3e-3
    rnn_hidden: int = 128
    gaussians: int = 5
    reward_ensemble: int = 5
    mdrnn_lr: float = 1e-3
    markov_reward: bool = False
    learn_location: bool = True
    match_input: typing.Literal["none", "score", "embedding"] = "embedding"
    location_lr: float = 1e-3
    controller_hidden: int = 128
    controller_lr: float = 1e-3
    reward_scale: float = 10.0
    reward_symlog: float = 1.0

    @classmethod
    def of(cls, config) -> "AgentSpec":
        """The spec of a trainer Config (or any object or mapping with these fields; missing ones take defaults)."""
        get = config.get if isinstance(config, Mapping) else lambda name, default: getattr(config, name, default)
        return cls(**{f.name: get(f.name, f.default) for f in dataclasses.fields(cls)})


class Agent:
    """V, M, the controller and the location scorer (None with `learn_location` off) with their optimisers (what a
    checkpoint holds besides the replay and curves).

    `optimisers=False` leaves the optimisers out (None), for an agent that only acts: building the first Adam imports
    torch._dynamo, 2 s of every agent search's 10 s limit.
    """

    def __init__(self, spec: AgentSpec, n_rules: int, optimisers: bool = True):
        from rlflow.agents.controller import LatentPolicy
        from rlflow.worldmodel.location import LocationScorer, match_width
        from rlflow.worldmodel.mdrnn import MDRNN
        from rlflow.worldmodel.vae import GraphVAE

        spec = spec if isinstance(spec, AgentSpec) else AgentSpec.of(spec)  # a trainer's Config is a spec
        self.spec, self.n_rules = spec, n_rules
        self.vision = GraphVAE(n_rules, spec.hidden, spec.rounds, spec.latent_size)
        self.mdrnn = MDRNN(spec.latent_size, n_rules + 1, n_rules, spec.rnn_hidden, spec.gaussians,
                           spec.reward_ensemble, location_flag=spec.learn_location, markov_reward=spec.markov_reward,
                           match_features=match_width(spec.match_input, spec.hidden) if spec.learn_location else 0,
                           reward_knee=spec.reward_symlog / spec.reward_scale)
        self.policy = LatentPolicy(spec.latent_size + spec.rnn_hidden, n_rules + 1, spec.controller_hidden)
        self.location = LocationScorer(n_rules, spec.hidden, spec.rounds) if spec.learn_location else None
        adam = torch.optim.Adam if optimisers else lambda *args, **kwargs: None
        self.vision_opt = adam(self.vision.parameters(), lr=spec.vae_lr)
        self.mdrnn_opt = adam(self.mdrnn.parameters(), lr=spec.mdrnn_lr)
        self.policy_opt = adam(self.policy.parameters(), lr=spec.controller_lr, eps=1e-5)
        self.location_opt = adam(self.location.parameters(), lr=spec.location_lr) if self.location is not None else None

    def _parts(self) -> tuple[str, ...]:
        parts = ("vision", "mdrnn", "policy", "vision_opt", "mdrnn_opt", "policy_opt", "location", "location_opt")
        return tuple(name for name in parts if getattr(self, name) is not None)

    def state_dict(self) -> dict:
        data = {name: getattr(self, name).state_dict() for name in self._parts()}
        data["specs"] = {name: getattr(self, name).spec() for name in ("vision", "mdrnn", "policy", "location")
                         if getattr(self, name) is not None}
        return data

    def load_state_dict(self, data: dict) -> None:
        for name in self._parts():
            getattr(self, name).load_state_dict(data[name])


# ----------------------------------------------------------------------------------------------------- checkpoints
def save_checkpoint(path: str | os.PathLike, agent: Agent, config, **extra) -> Path:
    """Writes weights, optimiser states, the run's config (a dataclass or dict), rule-registry and observation
    versions and `extra` (atomically)."""
    from rlflow.env.features import OBS_VERSION
    from rlflow.rewrites import REGISTRY_VERSION, RULES

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": CHECKPOINT_FORMAT, "algo": "worldmodel", "registry_version": REGISTRY_VERSION,
               "rules": [r.name for r in RULES], "obs_version": OBS_VERSION,
               "config": dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config),
               "agent": agent.state_dict(), **extra}
    return save_checkpoint_atomic(payload, path)


def load_checkpoint(path: str | os.PathLike, registry_version: str | None = None,
                    optimisers: bool = True, prefix: bool = False) -> tuple[Agent, dict]:
    """The agent stored at `path` and the whole checkpoint; `optimisers=False`: an agent that only acts (see `Agent`;
    `prefix`: see `rlflow.agents.checkpoint.load_checkpoint_payload`).

    Raises:
        RlflowError: missing file, not a world-model checkpoint, or another rule registry or observation version
            (rule ids would mean other rules).
    """
    payload = load_checkpoint_payload(path, fmt=CHECKPOINT_FORMAT, registry_version=registry_version,
                                      algo="worldmodel", retrain="retrain (rlflow train --algo worldmodel)",
                                      prefix=prefix)
    # checkpoints from before the learned location used the first match, from before match_input no description,
    # from before reward_symlog rewards learnt as they are
    stored = {"learn_location": False, "match_input": "none", "reward_symlog": 0.0, **payload["config"]}
    agent = Agent(AgentSpec.of(stored), len(payload["rules"]), optimisers=optimisers)
    agent.load_state_dict(payload["agent"])
    return agent, payload


# ------------------------------------------------------------------------------------------------ on a real graph
@dataclass(frozen=True)
class Planning:
    """One-step planning in M for greedy episodes (`greedy_by="model"`, `rlflow.train.worldmodel.config.Config`): the rule
    M predicts to pay most, as the dream would pay it, instead of the controller's argmax; terminate once none is
    predicted to pay.  Greedy episodes of the controller fell short of what M knows: on the training models the same
    checkpoints returned more by M's predicted reward than by the controller's argmax.

    Attributes:
        reward_scale: M predicts rewards divided by this (`AgentSpec.reward_scale`).
        reward_penalty: the reward counted is the ensemble mean less this times its spread (the dream's pessimism).
        reward_range: (low, high) per rule, each a float or (R,): the real rewards each rule earned in M's training
            data (`rlflow.train.worldmodel.learn.dream_reward_range`); None: no clip.
    """

    reward_scale: float
    reward_penalty: float
    reward_range: tuple | None = None

    @classmethod
    def of(cls, config: Mapping, reward_range: tuple | None = None) -> "Planning | None":
        """The planning a run's config asks for (None: the controller's argmax, and for checkpoints from before
        `greedy_by`)."""
        if config.get("greedy_by", "controller") != "model":
            return None
        return cls(float(config.get("reward_scale", 10.0)), float(config.get("reward_penalty", 1.0)), reward_range)


class Memory:
    """What the agent carries through one real episode: V's encoding z of the current graph and M's memory h of the
    rewrites applied so far.  The controller acts on (z, h) masked by the rules that really have a match; after a
    rewrite, M's one-step cell advances h.  The actor and training's real episodes both step it.
    """

    def __init__(self, agent: Agent, planning: "Planning | None" = None):
        from rlflow.worldmodel.mdrnn import MDRNNCell

        self.agent = agent
        self.planning = planning
        self.cell = MDRNNCell(agent.mdrnn)
        self.reset()

    def reset(self) -> None:
        """A new episode: h back to M's initial state."""
        self.state = self.agent.mdrnn.initial_state(1)
        self._encoded = (None, None)  # (observation, its z): stepping after acting reuses what acting encoded

    @torch.no_grad()
    def latent(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(1, Z) V's encoding (the posterior mean) of a real observation."""
        from rlflow.env.observation import obs_to_torch

        if self._encoded[0] is not obs:
            self._encoded = (obs, self.agent.vision.encode(obs_to_torch(obs))[0])
        return self._encoded[1]

    def controller_input(self, obs: Mapping[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """((1, Z + H) state, (1, R + 1) bool mask: the rules with a listed match, and terminate)."""
        from rlflow.env.observation import rule_mask_from_obs

        mask = torch.as_tensor(rule_mask_from_obs(obs, self.agent.n_rules)).unsqueeze(0)
        return torch.cat([self.latent(obs), self.state[0]], -1), mask

    @torch.no_grad()
    def rule_logits(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(R + 1,) the controller's masked logits over rules and terminate (the last) at this graph."""
        return self.agent.policy.logits(*self.controller_input(obs))[0]

    @torch.no_grad()
    def step(self, rule: int, obs: Mapping[str, np.ndarray], where: torch.Tensor | None = None) -> None:
        """Advances h by `rule` applied to the graph of `obs` (`where`: M's location input, (1, 1 + F); None for the
        agent's own choice of location, as in the dream)."""
        _, self.state = self.cell(torch.tensor([rule]), self.latent(obs), self.state, where)

    @torch.no_grad()
    def greedy_rule_scores(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(R + 1,) what a greedy episode takes the argmax of: the controller's logits, or with `planning` the reward
        M predicts for each available rule (`predicted_rewards`)."""
        return self.rule_logits(obs) if self.planning is None else self.predicted_rewards(obs)

    @torch.no_grad()
    def predicted_rewards(self, obs: Mapping[str, np.ndarray]) -> torch.Tensor:
        """(R + 1,) the reward the dream would pay for each rule with a listed match, one step through M from here:
        the ensemble mean less `reward_penalty` times its spread, in % of the runtime, clipped to the rule's range
        (`Planning`); terminate 0, unavailable rules NEG."""
        from rlflow.env.observation import NEG

        plan = self.planning
        _, mask = self.controller_input(obs)
        rules = torch.nonzero(mask[0, :-1]).squeeze(-1)
        rewards = torch.full((self.agent.n_rules + 1,), NEG)
        rewards[-1] = 0.0
        if not len(rules):
            return rewards
        state = tuple(part.expand(len(rules), -1).contiguous() for part in self.state)
        out, _ = self.cell(rules, self.latent(obs).expand(len(rules), -1), state)
        paid = (out.reward - plan.reward_penalty * out.reward_std) * plan.reward_scale
        if plan.reward_range is not None:
            low, high = (torch.as_tensor(bound, dtype=torch.float32).expand(self.agent.n_rules)[rules]
                         for bound in plan.reward_range)
            paid = torch.minimum(torch.maximum(paid, low), high)
        rewards[rules] = paid
        return rewards

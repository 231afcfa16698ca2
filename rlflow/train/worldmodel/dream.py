"""The dream: an environment that steps entirely inside the world model (M), never touching a real graph.

The state is (z, h): a latent graph state and the MDN-RNN's hidden state.  An episode starts from the latent of one
of the given real states (their VAE posteriors, encoded once beforehand and sampled at each reset): the starting
graphs, and optionally states met later in real episodes together with the MDN-RNN's hidden state there and the
steps already taken (`real_starts`), so that dreams stay short and close to real data (MBPO's branched rollouts).  Actions are
rule ids plus terminate (see `rlflow.worldmodel.mdrnn`); the action mask is the world model's own prediction of which
rules have a match, `sigmoid(mask_logits(z, h)) > 0.5`, with terminate always valid, so nothing here needs the real
environment.  A step through rule r samples z' from the mixture at the chosen `temperature`, pays the predicted
reward and ends the episode when termination is predicted (p > 0.5) or no rule is predicted available; like the real
environment, `max_episode_steps` truncates and a masked action costs `invalid_penalty` and changes nothing.

The reward paid is pessimistic (MOPO): the reward ensemble's mean minus `reward_penalty` times its spread, clipped to
`reward_range` (per rule: the range of the real rewards that rule earned in M's training data), and cut so that an
episode's return never exceeds its start's cap (the best return real episodes reached from there), so that a
controller gains nothing by steering into states where the world model is unsure, extrapolates beyond what was ever
observed, or repeats a rewrite that really pays only once.

`DreamBatch` steps many dreams at once (the trainer's vectorised environment); `DreamEnv` is the Gymnasium view of
one of them.
"""
from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from gymnasium import spaces

from rlflow.worldmodel.mdrnn import MDRNN, MDRNNCell, sample_gmm


class DreamBatch:
    """`n_envs` dreams stepped together (auto-reset: a finished dream restarts at once, as in Gymnasium's vector envs).

    Args:
        mdrnn: the trained world model.
        start_mu, start_logvar: (S, Z) posteriors of the real starting graphs.
        n_envs: dreams in the batch.
        temperature: sampling temperature of z' (0: the most likely component's mean).
        max_episode_steps: truncation.
        reward_scale: rewards are predicted divided by this (as trained).
        invalid_penalty: reward of a masked action.
        reward_penalty: the reward paid is the ensemble mean minus this times the ensemble spread.
        reward_range: (low, high) clip of the reward paid (real units), each a float or an (R,) tensor per rule;
            None: no clip.
        start_state: (h, c), each (S, H): the MDN-RNN state at each start (zeros when None).
        start_steps: (S,) steps already taken at each start (count towards `max_episode_steps`; zeros when None).
        start_weights: (S,) relative probability of each start (uniform when None).
        start_caps: (S,) the most a dream episode from each start may earn in total (None: no cap); rewards are
            cut so that the running return never exceeds it.
        horizon: at most this many dream steps per episode (None: only `max_episode_steps`).
        seed: seeds the batch's torch generator.
    """

    def __init__(self, mdrnn: MDRNN, start_mu: torch.Tensor, start_logvar: torch.Tensor, n_envs: int = 1, *,
                 temperature: float = 1.0, max_episode_steps: int = 25, reward_scale: float = 1.0,
                 invalid_penalty: float = -1.0, reward_penalty: float = 0.0,
                 reward_range: tuple[float | torch.Tensor, float | torch.Tensor] | None = None,
                 start_state: tuple[torch.Tensor, torch.Tensor] | None = None, start_steps: torch.Tensor | None = None,
                 start_weights: torch.Tensor | None = None, start_caps: torch.Tensor | None = None,
                 horizon: int | None = None, seed: int | None = None):
        if start_mu.dim() != 2 or start_mu.shape != start_logvar.shape or start_mu.shape[0] == 0:
            raise ValueError("start_mu and start_logvar must be (S, Z) with S >= 1")
        starts = start_mu.shape[0]
        self.start_h, self.start_c = ((torch.zeros(starts, mdrnn.hidden), torch.zeros(starts, mdrnn.hidden))
                                      if start_state is None else (start_state[0].detach().float(),
                                                                   start_state[1].detach().float()))
        self.start_steps = torch.zeros(starts, dtype=torch.long) if start_steps is None else start_steps.long()
        self.start_weights = torch.ones(starts) if start_weights is None else start_weights.float()
        if self.start_h.shape != (starts, mdrnn.hidden) or self.start_steps.shape != (starts,) \
                or self.start_weights.shape != (starts,):
            raise ValueError("start_state, start_steps and start_weights must have one row per start")
        self.start_caps = None if start_caps is None else start_caps.float()
        if self.start_caps is not None and self.start_caps.shape != (starts,):
            raise ValueError("start_caps must have one row per start")
        self.reward_penalty = float(reward_penalty)
        self.reward_low, self.reward_high = ((None, None) if reward_range is None else
                                             (torch.as_tensor(reward_range[0], dtype=torch.float32).expand(mdrnn.n_rules),
                                              torch.as_tensor(reward_range[1], dtype=torch.float32).expand(mdrnn.n_rules)))
        self.horizon = horizon
        self.cell = MDRNNCell(mdrnn).eval()
        self.n_envs, self.temperature = n_envs, float(temperature)
        self.max_episode_steps, self.reward_scale = max_episode_steps, float(reward_scale)
        self.invalid_penalty = float(invalid_penalty)
        self.start_mu, self.start_logvar = start_mu.detach().float(), start_logvar.detach().float()
        self.latent_size, self.hidden = mdrnn.latent_size, mdrnn.hidden
        self.n_rules, self.terminate = mdrnn.n_rules, mdrnn.n_rules
        self.obs_size = self.latent_size + self.hidden
        self.generator = torch.Generator()
        self.seed(seed)
        self.z = torch.zeros(n_envs, self.latent_size)
        self.h, self.c = mdrnn.initial_state(n_envs)
        self.rule_mask = torch.zeros(n_envs, self.n_rules, dtype=torch.bool)
        self.steps = torch.zeros(n_envs, dtype=torch.long)
        self.dream_steps = torch.zeros(n_envs, dtype=torch.long)
        self.budget = torch.full((n_envs,), float("inf"))
        self.start_index = torch.zeros(n_envs, dtype=torch.long)

    def seed(self, seed: int | None) -> None:
        self.generator.manual_seed(int(seed) if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()))

    @torch.no_grad()
    def reset(self, which: torch.Tensor | None = None) -> None:
        """Restarts the dreams where `which` (B,) bool is set (all when None) from sampled starting latents."""
        which = torch.ones(self.n_envs, dtype=torch.bool) if which is None else which
        n = int(which.sum())
        if n == 0:
            return
        index = torch.multinomial(self.start_weights, n, replacement=True, generator=self.generator)
        eps = torch.randn(n, self.latent_size, generator=self.generator)
        self.z[which] = self.start_mu[index] + (0.5 * self.start_logvar[index]).exp() * eps * (self.temperature > 0)
        self.h[which] = self.start_h[index]
        self.c[which] = self.start_c[index]
        self.steps[which] = self.start_steps[index]
        self.dream_steps[which] = 0
        self.budget[which] = float("inf") if self.start_caps is None else self.start_caps[index]
        self.start_index[which] = index
        self.rule_mask[which] = self.cell.mdrnn.mask_logits(self.z[which], self.h[which]) > 0

    def observation(self) -> torch.Tensor:
        """(B, Z + H) float: z and h side by side (what the controller reads)."""
        return torch.cat([self.z, self.h], -1)

    def action_mask(self) -> torch.Tensor:
        """(B, R + 1) bool: the predicted available rules and terminate (always)."""
        return torch.cat([self.rule_mask, torch.ones(self.n_envs, 1, dtype=torch.bool)], -1)

    @torch.no_grad()
    def step(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Steps every dream.

        Args:
            actions: (B,) long.

        Returns:
            rewards (B,), terminated (B,) bool, truncated (B,) bool, and info with `invalid` (B,) bool and
            `final_observation` (B, Z + H) (the state before an auto-reset).  Finished dreams are restarted, so
            `observation()` is the next state of each dream.
        """
        actions = actions.long()
        rewards = torch.zeros(self.n_envs)
        terminated = actions == self.terminate
        rule = ~terminated
        valid = torch.ones(self.n_envs, dtype=torch.bool)
        valid[rule] = self.rule_mask[rule, actions[rule]]
        invalid = rule & ~valid
        rewards[invalid] = self.invalid_penalty
        go = rule & valid
        if go.any():
            out, (h, c) = self.cell(actions[go], self.z[go], (self.h[go], self.c[go]))
            z_next = sample_gmm(out.mus, out.sigmas, out.logpi, self.temperature, self.generator)
            paid = (out.reward - self.reward_penalty * out.reward_std) * self.reward_scale
            if self.reward_low is not None:
                paid = torch.minimum(torch.maximum(paid, self.reward_low[actions[go]]), self.reward_high[actions[go]])
            paid = torch.minimum(paid, self.budget[go])
            self.budget[go] -= paid
            rewards[go] = paid
            mask_next = self.cell.mdrnn.mask_logits(z_next, h) > 0
            self.z[go], self.h[go], self.c[go], self.rule_mask[go] = z_next, h, c, mask_next
            ended = (torch.sigmoid(out.done_logit) > 0.5) | ~mask_next.any(-1)
            terminated[go] = ended
        self.steps += 1
        self.dream_steps += 1
        limit = self.steps >= self.max_episode_steps
        if self.horizon is not None:
            limit |= self.dream_steps >= self.horizon
        truncated = ~terminated & limit
        final = self.observation().clone()
        self.reset(terminated | truncated)
        return rewards, terminated, truncated, {"invalid": invalid, "final_observation": final}


class DreamEnv(gym.Env):
    """Rewrite a graph inside the world model (Gymnasium view of one dream).

    ## Description
    The hallucinated counterpart of `rlflow/Rewrite-v0`: the state is the world model's (z, h) and every step is
    predicted by the MDN-RNN; no graph, rule or cost model is touched after construction.

    ## Action Space
    `Discrete(R + 1)`: apply (one match of) rule r, or terminate (the last action).  `info["action_mask"]` (int8)
    marks the rules the world model predicts to be available, and terminate.

    ## Observation Space
    `Box(-inf, inf, (Z + H,), float32)`: z then h.

    ## Rewards
    The world model's predicted reward (in the real environment's units: percent of the initial runtime saved);
    `invalid_penalty` for a masked action; 0 for terminate.

    ## Episode End
    Terminated: terminate, predicted termination, or no rule predicted available.  Truncated: `max_episode_steps`.

    ## Arguments
    `mdrnn`, `start_mu`, `start_logvar` (posteriors of the real starting graphs), `temperature` (spread of z'
    sampling; 0 is deterministic), `max_episode_steps`, `reward_scale`, `invalid_penalty`.

    ## Version History
    * v0: first version.
    """

    metadata = {"render_modes": []}

    def __init__(self, mdrnn: MDRNN, start_mu: torch.Tensor, start_logvar: torch.Tensor, *, temperature: float = 1.0,
                 max_episode_steps: int = 25, reward_scale: float = 1.0, invalid_penalty: float = -1.0):
        super().__init__()
        self.batch = DreamBatch(mdrnn, start_mu, start_logvar, 1, temperature=temperature,
                                max_episode_steps=max_episode_steps, reward_scale=reward_scale,
                                invalid_penalty=invalid_penalty, seed=0)
        self.temperature = temperature
        self.observation_space = spaces.Box(-np.inf, np.inf, (self.batch.obs_size,), np.float32)
        self.action_space = spaces.Discrete(self.batch.n_rules + 1)
        self._started = False

    def _obs(self) -> np.ndarray:
        return self.batch.observation()[0].numpy().astype(np.float32)

    def _info(self, **extra) -> dict[str, Any]:
        return {"action_mask": self.batch.action_mask()[0].numpy().astype(np.int8),
                "episode_steps": int(self.batch.steps[0]), **extra}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self.batch.seed(int(self.np_random.integers(0, 2**31 - 1)))
        self.batch.reset()
        self._started = True
        return self._obs(), self._info()

    def step(self, action):
        if not self._started:
            raise RuntimeError("call reset() first")
        rewards, terminated, truncated, info = self.batch.step(torch.tensor([int(action)]))
        done = bool(terminated[0] or truncated[0])
        obs = info["final_observation"][0].numpy().astype(np.float32) if done else self._obs()
        if done:
            self._started = False
        return obs, float(rewards[0]), bool(terminated[0]), bool(truncated[0]), self._info(
            invalid_action=bool(info["invalid"][0]))


@torch.no_grad()
def real_starts(mdrnn: MDRNN, episodes: list, mu: torch.Tensor, logvar: torch.Tensor,
                descriptors: dict | None = None) -> dict[str, torch.Tensor]:
    """Dream starts at every state of real `episodes` where an action was chosen: the state's posterior, the
    MDN-RNN's state there (M run over the episode with the posterior means, as in a real rollout) and the step.

    Args:
        mdrnn: the trained world model.
        episodes: `rlflow.train.worldmodel.replay.Episode`s.
        mu, logvar: (S, Z) posteriors of every replay state.
        descriptors: id(episode) -> (steps, F) descriptions of its random matches
            (`rlflow.worldmodel.location.match_descriptors`), for an M that reads them; None: none.

    Returns:
        `mu`, `logvar` (N, Z), `h`, `c` (N, H), `steps` (N,) long, `first` (N,) bool (a starting graph),
        `episode` (N,) long (index into `episodes`).
    """
    cell = MDRNNCell(mdrnn).eval()
    rows: dict[str, list] = {"state": [], "h": [], "c": [], "steps": [], "episode": []}
    index = [i for i, e in enumerate(episodes) if e.actions]
    episodes = [episodes[i] for i in index]
    if not episodes:
        raise ValueError("no episode with an action")
    t_max = max(len(e.actions) for e in episodes)
    h, c = mdrnn.initial_state(len(episodes))
    for t in range(t_max):
        live = [i for i, e in enumerate(episodes) if t < len(e.actions)]
        states = torch.as_tensor([episodes[i].states[t] for i in live])
        rows["state"].append(states)
        rows["h"].append(h[live].clone())
        rows["c"].append(c[live].clone())
        rows["steps"].append(torch.full((len(live),), t, dtype=torch.long))
        rows["episode"].append(torch.as_tensor([index[i] for i in live], dtype=torch.long))
        actions = torch.as_tensor([min(episodes[i].actions[t], mdrnn.n_actions - 1) for i in live])
        flags = torch.as_tensor([float(episodes[i].random_locations[t]) if episodes[i].random_locations else 0.0
                                 for i in live])
        if descriptors is not None:
            flags = torch.cat([flags.unsqueeze(-1), torch.stack([descriptors[id(episodes[i])][t] for i in live])], -1)
        _, (h_new, c_new) = cell(actions, mu[states], (h[live], c[live]), flags)
        h[live], c[live] = h_new, c_new
    states = torch.cat(rows["state"])
    steps = torch.cat(rows["steps"])
    return {"mu": mu[states], "logvar": logvar[states], "h": torch.cat(rows["h"]), "c": torch.cat(rows["c"]),
            "steps": steps, "first": steps == 0, "episode": torch.cat(rows["episode"])}


__all__ = ["DreamBatch", "DreamEnv", "real_starts"]

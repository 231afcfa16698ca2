"""Masked PPO's real steps: a policy playing one environment for a number of steps, episodes running on from one
rollout to the next (`play`), and what it returns (`Rollout`).  Apart from the update (`rlflow.train.ppo.Learner`)
so that the same steps are played here or on a cluster's nodes (`rlflow.train.cluster`), where each node plays one
segment of the update's rollout with its own environment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Stream:
    """An environment and where its episode stands between rollouts."""

    env: object
    next_obs: dict | None = None
    next_done: float = 0.0
    episode_return: float = 0.0

    def start(self, seed: int) -> "Stream":
        self.next_obs, _ = self.env.reset(seed=seed)
        return self


@dataclass
class Rollout:
    """`len(actions)` consecutive real steps of one environment: what the update needs (observations, actions, their
    log-probabilities and values, rewards, done flags) and where the stream went next (`next_obs`, `next_done`, for
    bootstrapping the last step), the episodes that ended in it (`step`: the step, counted from 1, after which each
    ended), and the environment's counters over it."""

    buffers: dict[str, np.ndarray]
    actions: np.ndarray
    logprobs: np.ndarray
    values: np.ndarray
    rewards: np.ndarray
    dones: np.ndarray
    next_obs: dict
    next_done: float
    episodes: list[dict] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)


COUNTERS = ("real_steps", "measurements", "cost_evaluations")


def play(policy, stream: Stream, steps: int, gamma: float) -> Rollout:
    """`steps` real steps of `policy` (sampled actions) on the stream's environment, episodes continuing across
    calls; a time-limited episode's last reward is bootstrapped with the value of where it stopped."""
    import torch

    from rlflow.env.observation import obs_to_torch

    env = stream.env
    spaces = env.observation_space.spaces
    buffers = {key: np.zeros((steps, *sub.shape), sub.dtype) for key, sub in spaces.items()}
    actions = np.zeros(steps, np.int64)
    logprobs, values, rewards, dones = (np.zeros(steps, np.float32) for _ in range(4))
    before = {name: getattr(env, name) for name in COUNTERS}
    episodes = []
    for t in range(steps):
        for key in buffers:
            buffers[key][t] = stream.next_obs[key]
        dones[t] = stream.next_done
        with torch.no_grad():
            action, logprob, _, value = policy.get_action_and_value(obs_to_torch(stream.next_obs))
        actions[t], logprobs[t], values[t] = int(action.item()), float(logprob), float(value)
        stream.next_obs, reward, terminated, truncated, info = env.step(int(action.item()))
        stream.episode_return += reward
        if truncated and not terminated:  # bootstrap through the time limit: the episode did not really end
            with torch.no_grad():
                reward += gamma * float(policy.get_value(obs_to_torch(stream.next_obs)).item())
        rewards[t] = reward
        stream.next_done = float(terminated or truncated)
        if stream.next_done:
            episodes.append({"step": t + 1, "model": info["model"], "return": stream.episode_return,
                             "length": info["episode_steps"], "speedup": info["speedup"]})
            stream.episode_return = 0.0
            stream.next_obs, info = env.reset()
    counters = {name: getattr(env, name) - before[name] for name in COUNTERS}
    return Rollout(buffers, actions, logprobs, values, rewards, dones, stream.next_obs, stream.next_done, episodes,
                   counters)


__all__ = ["COUNTERS", "Rollout", "Stream", "play"]

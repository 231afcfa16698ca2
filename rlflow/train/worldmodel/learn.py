"""One iteration's learning from the replay, in the world-model agent's training (`rlflow.train.worldmodel.loop`):
V's epochs, M's epochs (each reward head on its bootstrap share of the episodes), and the dream the controller is
trained in, with the reward clip the real rewards give it.
"""
from __future__ import annotations

import typing

import numpy as np

from rlflow.agents.worldmodel_agent import Agent

if typing.TYPE_CHECKING:
    from rlflow.train.worldmodel.config import Config


def train_vision(agent: Agent, replay, ids: list[int], episodes: list, config: Config, rng: np.random.Generator,
                 progress=None) -> dict:
    """Epochs of V over the training states (rewards observed in `episodes`); returns the last epoch's mean
    losses."""
    from rlflow.worldmodel.vae import graph_vae_loss

    agent.vision.train()
    table = replay.reward_table(episodes, config.reward_scale)
    ids = np.asarray(ids)
    totals: dict[str, float] = {}
    for _ in range(config.vae_epochs):
        totals, batches = {}, 0
        shuffled = ids[rng.permutation(len(ids))]
        for begin in range(0, len(ids), config.vae_batch):
            chunk = shuffled[begin: begin + config.vae_batch]
            obs = replay.batch(chunk.tolist())
            out = agent.vision(obs)
            target, known = replay.reward_targets(chunk.tolist(), table)
            losses = graph_vae_loss(out, replay.masks(chunk.tolist()), obs["graph"], config.beta,
                                    reward_target=target, reward_known=known)
            _step(agent.vision_opt, agent.vision, losses, totals)
            batches += 1
        totals = {k: v / max(batches, 1) for k, v in totals.items()}
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{totals['loss']:.2f}", kl=f"{totals['kl']:.2f}")
    return totals


def train_mdrnn(agent: Agent, replay, episodes: list, mu, logvar, config: Config, rng: np.random.Generator,
                progress=None, descriptors: dict | None = None) -> dict:
    """Epochs of M over the training episodes (z sampled from V's posteriors each epoch, or their means; random
    matches described by `descriptors`, see `rlflow.train.worldmodel.replay.sequences`); returns the last epoch's mean
    losses.

    With `config.mdrnn_validation`, that share of the episodes (drawn afresh each call, so every episode trains M
    in most iterations) is set aside, and M keeps the weights of the epoch with the lowest loss on them: M fits its
    training episodes almost exactly (reward Pearson 0.99 there against 0.55 on held-out ones), and later epochs
    mostly memorise.
    """
    import copy

    import torch

    from rlflow.train.worldmodel.replay import sequences
    from rlflow.worldmodel.mdrnn import mdrnn_loss

    masks = torch.as_tensor(np.stack(replay.rule_masks))
    terminate = agent.n_rules

    members = reward_bootstrap(replay, config.reward_ensemble, config.reward_bootstrap, config.seed)

    def losses_of(chunk: list, sample: bool) -> dict:
        seq = sequences(chunk, mu, logvar, masks, terminate, sample=sample, reward_scale=config.reward_scale,
                        descriptors=descriptors)
        out = agent.mdrnn(seq["actions"], seq["latents"], flags=seq["flags"])
        weights = torch.stack([members[id(e)] for e in chunk]) if members else None
        return mdrnn_loss(out, seq["next_latents"], seq["rewards"], seq["dones"], seq["masks"], seq["valid"],
                          seq["state_valid"], config.mask_weight, weights)

    held = int(round(config.mdrnn_validation * len(episodes))) if len(episodes) >= 10 else 0
    validation: list = []
    if held:  # (no draw otherwise: runs without a validation share keep their random stream)
        order = rng.permutation(len(episodes))
        validation, episodes = [episodes[i] for i in order[:held]], [episodes[i] for i in order[held:]]
    best_loss, best_state, best_epoch = float("inf"), None, 0
    totals: dict[str, float] = {}
    for epoch in range(1, config.mdrnn_epochs + 1):
        agent.mdrnn.train()
        order = rng.permutation(len(episodes))
        totals, batches = {}, 0
        for begin in range(0, len(order), config.mdrnn_batch):
            losses = losses_of([episodes[i] for i in order[begin: begin + config.mdrnn_batch]],
                               config.sample_latents)
            _step(agent.mdrnn_opt, agent.mdrnn, losses, totals)
            batches += 1
        totals = {k: v / max(batches, 1) for k, v in totals.items()}
        if validation:
            agent.mdrnn.eval()
            with torch.no_grad():
                totals["validation_loss"] = float(losses_of(validation, False)["loss"])
            if totals["validation_loss"] < best_loss:
                best_loss, best_state, best_epoch = (totals["validation_loss"],
                                                     copy.deepcopy(agent.mdrnn.state_dict()), epoch)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{totals['loss']:.3f}", reward=f"{totals['reward_mse']:.3f}")
    if best_state is not None:
        agent.mdrnn.load_state_dict(best_state)
        totals.update(best_epoch=float(best_epoch), best_validation_loss=best_loss)
    agent.mdrnn.eval()
    return totals


def _step(optimizer, module, losses: dict, totals: dict) -> None:
    """One gradient step of `module` on `losses["loss"]` (gradient norm clipped to 5), each loss added to `totals`:
    what an epoch of V and one of M do per batch."""
    import torch

    optimizer.zero_grad()
    losses["loss"].backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 5.0)
    optimizer.step()
    for key, value in losses.items():
        totals[key] = totals.get(key, 0.0) + float(value.detach())


def reward_bootstrap(replay, members: int, share: float, seed: int) -> dict:
    """id(episode) -> (members,) 0/1: which reward-ensemble members learn from each episode of `replay`, each member
    from about `share` of them (at least one member per episode); empty when `share` is 0 or 1 (all learn from all).

    An episode keeps its draw for the whole run (it is seeded by the episode's place in the replay), so members
    trained over many iterations stay apart: with every member fitting every transition, the members agree where
    M has memorised its data and disagree nowhere, and their mean inherits M's wild guesses on new transitions."""
    import torch

    if share <= 0 or share >= 1:
        return {}
    out = {}
    for index, episode in enumerate(replay.episodes):
        draw = np.random.default_rng([seed, index]).random(members) < share
        if not draw.any():
            draw[np.random.default_rng([seed, index, 1]).integers(members)] = True
        out[id(episode)] = torch.as_tensor(draw, dtype=torch.float32)
    return out


def dream_reward_range(episodes: list, n_rules: int):
    """The dream's reward clip from real episodes: (low, high), each (R,): low the lowest reward any rule earned,
    high per rule the highest it earned (0 for a rule never seen earning more than nothing)."""
    import torch

    low, high = torch.zeros(n_rules), torch.zeros(n_rules)
    for e in episodes:
        for a, r in zip(e.actions, e.rewards):
            if a < n_rules:
                low[a], high[a] = min(float(low[a]), r), max(float(high[a]), r)
    return torch.full((n_rules,), float(low.min())), high


def make_dream(agent: Agent, episodes: list, mu, logvar, config: Config, seed: int,
               descriptors: dict | None = None):
    """The controller's `DreamBatch`: starts at the states of `episodes` (a `first_start_share` of the dreams at
    starting graphs), pessimistic rewards clipped per rule to the range of the real rewards the rule earned in
    `episodes` (a rule never seen earning more than nothing earns nothing in the dream either) and, with
    `cap_returns`, dream returns capped at the best return real episodes of the same model reached (less what the
    start's episode had already earned)."""
    import torch

    from rlflow.train.worldmodel.dream import DreamBatch, real_starts

    starts = real_starts(agent.mdrnn, episodes, mu, logvar, descriptors)
    first = starts["first"]
    share = config.first_start_share if bool((~first).any()) else 1.0
    weights = torch.where(first, share / first.sum().clamp_min(1), (1 - share) / (~first).sum().clamp_min(1))
    reward_range = dream_reward_range(episodes, agent.n_rules)
    best: dict[str, float] = {}  # per model, the best return a real (training) episode reached at any step
    for e in episodes:
        best[e.model] = max(best.get(e.model, 0.0), float(np.max(np.cumsum([0.0] + e.rewards))))
    so_far = [float(sum(episodes[i].rewards[:t])) for i, t in zip(starts["episode"].tolist(), starts["steps"].tolist())]
    caps = torch.tensor([max(0.0, best[episodes[i].model] - done) for i, done in zip(starts["episode"].tolist(), so_far)])
    start_logvar = starts["logvar"] if config.sample_latents else torch.full_like(starts["logvar"], -float("inf"))
    return DreamBatch(agent.mdrnn, starts["mu"], start_logvar, config.dream_envs, temperature=config.temperature,
                      max_episode_steps=config.max_episode_steps, reward_scale=config.reward_scale,
                      reward_penalty=config.reward_penalty, reward_range=reward_range,
                      start_state=(starts["h"], starts["c"]), start_steps=starts["steps"], start_weights=weights,
                      start_caps=caps if config.cap_returns else None,
                      horizon=config.dream_horizon or None, seed=seed)


__all__ = ["dream_reward_range", "make_dream", "reward_bootstrap", "train_mdrnn", "train_vision"]

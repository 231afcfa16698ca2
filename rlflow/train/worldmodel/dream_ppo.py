"""Training the world-model agent's controller (`rlflow.agents.controller.LatentPolicy`) with PPO inside the dream.

CleanRL's ppo.py on a vectorised environment (`rlflow.train.worldmodel.dream.DreamBatch`): rollouts of `num_steps` steps
in `num_envs` dreams, GAE, clipped surrogate, clipped value loss, entropy bonus.  The policy picks a rule type (or
terminate) among those the world model predicts to be available; in the real environment the same policy is masked
with the real availability instead (`rule_mask_from_obs`) and the rule is applied where the learned location scorer
rates best (`rlflow.worldmodel.location`; its first listed match for agents without one).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from rlflow.agents.controller import LatentPolicy


@dataclass
class DreamPPOConfig:
    """PPO settings for training in the dream (CleanRL's names).

    Attributes:
        total_steps: dream steps per call of `train_in_dream`.
        num_envs: dreams stepped together.
        num_steps: steps per dream per rollout.
        learning_rate: Adam learning rate.
        gamma: discount.
        gae_lambda: GAE lambda.
        num_minibatches: minibatches per epoch.
        update_epochs: epochs per rollout.
        clip_coef: PPO clip.
        ent_coef: entropy bonus.
        vf_coef: value loss weight.
        max_grad_norm: gradient clipping.
    """

    total_steps: int = 60_000
    num_envs: int = 64
    num_steps: int = 32
    learning_rate: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    clip_coef: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5


def train_in_dream(policy: LatentPolicy, optimizer: torch.optim.Optimizer, dream, config: DreamPPOConfig,
                   progress=None) -> dict:
    """Trains `policy` for `config.total_steps` steps of the vectorised `dream` (a `DreamBatch`).

    Returns:
        Statistics: mean dream episode return and length over the last rollouts, losses of the last update.
    """
    n, t_max = config.num_envs, config.num_steps
    if dream.n_envs != n:
        raise ValueError(f"the dream has {dream.n_envs} environments, the config {n}")
    batch_size = n * t_max
    minibatch = max(1, batch_size // config.num_minibatches)
    updates = max(1, config.total_steps // batch_size)
    obs_buf = torch.zeros(t_max, n, dream.obs_size)
    mask_buf = torch.zeros(t_max, n, policy.n_actions, dtype=torch.bool)
    act_buf = torch.zeros(t_max, n, dtype=torch.long)
    logp_buf, rew_buf, done_buf, val_buf = (torch.zeros(t_max, n) for _ in range(4))
    dream.reset()
    next_done = torch.zeros(n)
    running = torch.zeros(n)
    lengths = torch.zeros(n)
    finished: list[tuple[float, float]] = []
    stats: dict = {}
    for _ in range(updates):
        for t in range(t_max):
            obs, mask = dream.observation(), dream.action_mask()
            obs_buf[t], mask_buf[t], done_buf[t] = obs, mask, next_done
            with torch.no_grad():
                action, logp, _, value = policy.get_action_and_value(obs, mask)
            act_buf[t], logp_buf[t], val_buf[t] = action, logp, value
            reward, terminated, truncated, info = dream.step(action)
            running += reward
            lengths += 1
            ended = terminated | truncated
            if truncated.any():  # bootstrap through the time limit
                with torch.no_grad():
                    reward = reward + config.gamma * policy.get_value(info["final_observation"]) * truncated.float()
            rew_buf[t] = reward
            next_done = ended.float()
            for i in torch.nonzero(ended).flatten().tolist():
                finished.append((float(running[i]), float(lengths[i])))
            running[ended] = 0.0
            lengths[ended] = 0.0
        with torch.no_grad():
            next_value = policy.get_value(dream.observation())
            advantages = torch.zeros(t_max, n)
            last = torch.zeros(n)
            for t in reversed(range(t_max)):
                if t == t_max - 1:
                    nonterminal, following = 1.0 - next_done, next_value
                else:
                    nonterminal, following = 1.0 - done_buf[t + 1], val_buf[t + 1]
                delta = rew_buf[t] + config.gamma * following * nonterminal - val_buf[t]
                last = delta + config.gamma * config.gae_lambda * nonterminal * last
                advantages[t] = last
            returns = advantages + val_buf
        b_obs, b_mask = obs_buf.reshape(batch_size, -1), mask_buf.reshape(batch_size, -1)
        b_act, b_logp = act_buf.reshape(-1), logp_buf.reshape(-1)
        b_adv, b_ret, b_val = advantages.reshape(-1), returns.reshape(-1), val_buf.reshape(-1)
        for _ in range(config.update_epochs):
            perm = torch.randperm(batch_size)
            for begin in range(0, batch_size, minibatch):
                mb = perm[begin: begin + minibatch]
                _, newlogp, entropy, newvalue = policy.get_action_and_value(b_obs[mb], b_mask[mb], b_act[mb])
                ratio = (newlogp - b_logp[mb]).exp()
                adv = b_adv[mb]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                pg_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)).mean()
                v_clipped = b_val[mb] + (newvalue - b_val[mb]).clamp(-config.clip_coef, config.clip_coef)
                v_loss = 0.5 * torch.max((newvalue - b_ret[mb]) ** 2, (v_clipped - b_ret[mb]) ** 2).mean()
                loss = pg_loss - config.ent_coef * entropy.mean() + config.vf_coef * v_loss
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
                optimizer.step()
        recent = finished[-4 * n:]
        stats = {"dream_return": float(np.mean([r for r, _ in recent])) if recent else float("nan"),
                 "dream_length": float(np.mean([length for _, length in recent])) if recent else float("nan"),
                 "policy_loss": float(pg_loss), "value_loss": float(v_loss), "entropy": float(entropy.mean())}
        if progress is not None:
            progress.update(batch_size)
            progress.set_postfix(ret=f"{stats['dream_return']:+.2f}", ent=f"{stats['entropy']:.2f}")
    stats["dream_episodes"] = len(finished)
    return stats


__all__ = ["DreamPPOConfig", "train_in_dream"]

"""World-model quality on held-out real transitions, and the PPO curve its plots compare against
(`rlflow.plots` draws them).

`quality` measures V and M on episodes that never trained them: V's reconstruction error and KL, M's mixture
negative log-likelihood of the next latent, reward error and Pearson correlation between predicted and real reward
(with Spearman's rank correlation beside it: rewards are heavy-tailed, so Pearson mostly says whether the few large
ones are predicted, Spearman whether the many small ones are ordered right, and Spearman over the transitions whose
real reward is at least `MOVED` whether those a measurement could tell apart are),
termination accuracy, and the accuracy of the predicted per-rule availability (the dream's action mask).  Mask
accuracy is given three ways, since most of the registry's rules never match a -tiny model and a predictor that says
"unavailable" everywhere already scores high per entry: per entry, per entry over the rules seen available at least
once, and per state (the whole mask right).  Transitions whose (state, rule) pair also occurs in the training
episodes are counted too (the environment is deterministic and starts from the same graphs, so many do): the
correlation is also given over the unseen ones, and separately over the transitions whose rule went where the agent's
location scorer chose (what the dream plays) and those that went to a random match (exploration: which match was
drawn is not in M's input, so their rewards are partly unpredictable by design), and per kind of episode
(`Episode.source`: the first random walks, the controller's collection, its greedy evaluation).
"""
from __future__ import annotations

import numpy as np
import torch

from rlflow.measure.ranks import pearson, spearman
from rlflow.train.worldmodel.replay import Episode, Replay, sequences

MOVED = 0.2
"""Smallest real reward, in % of the estimated runtime, that `reward_spearman_moved` ranks: below it a step changes
the graph's time by less than an end-to-end measurement separates (on a table filled one process at a time, a
quarter of the held-out transitions lie under it, a tenth at exactly 0, and their order is most of what keeps
Spearman below Pearson)."""


@torch.no_grad()
def encode_all(vision, replay: Replay, batch: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Posteriors (mu, logvar), each (S, Z), of every replay state."""
    vision.eval()
    mus, logvars = [], []
    for begin in range(0, len(replay.states), batch):
        mu, logvar = vision.encode(replay.batch(range(begin, min(begin + batch, len(replay.states)))))
        mus.append(mu)
        logvars.append(logvar)
    return torch.cat(mus), torch.cat(logvars)


@torch.no_grad()
def quality(vision, mdrnn, replay: Replay, episodes: list[Episode], train_episodes: list[Episode],
            mu: torch.Tensor, logvar: torch.Tensor, reward_scale: float,
            descriptors: dict | None = None) -> dict:
    """World-model figures on `episodes` (held out; random matches described by `descriptors`, see
    `rlflow.train.worldmodel.replay.sequences`); see the module docstring."""
    from rlflow.worldmodel.vae import kl_divergence

    if not episodes:
        return {}
    vision.eval()
    mdrnn.eval()
    ids = replay.state_ids(episodes)
    recon, kl = [], []
    for begin in range(0, len(ids), 128):
        out = vision(replay.batch(ids[begin: begin + 128]), sample=False)
        recon.append((out.recon - out.embedding).pow(2).sum(-1))
        kl.append(kl_divergence(out.mu, out.logvar))
    recon, kl = torch.cat(recon), torch.cat(kl)
    masks = torch.as_tensor(np.stack(replay.rule_masks))
    terminate = mdrnn.n_rules
    seq = sequences(episodes, mu, logvar, masks, terminate, sample=False, reward_scale=reward_scale,
                    descriptors=descriptors)
    out = mdrnn(seq["actions"], seq["latents"], flags=seq["flags"])
    from rlflow.worldmodel.mdrnn import gmm_loss

    valid = seq["valid"].bool()
    nll = gmm_loss(seq["next_latents"], out.mus, out.sigmas, out.logpi, reduce=False)[valid]
    predicted = (out.reward[valid] * reward_scale).numpy()
    real = (seq["rewards"][valid] * reward_scale).numpy()
    bits = seq["flags"] if seq["flags"].dim() == 2 else seq["flags"][..., 0]
    at_random = bits[valid].bool().numpy()  # the rule went to a random match (exploration)
    done_pred = (out.done_logit[valid] > 0).numpy()
    done_real = seq["dones"][valid].bool().numpy()
    state_valid = seq["state_valid"].bool()
    mask_pred = (out.mask_logits[state_valid] > 0).numpy()
    mask_real = seq["masks"][state_valid].bool().numpy()
    seen_rules = masks.any(0).numpy()
    # (state, action) pairs that training episodes also contain
    trained_pairs = {(s, a) for e in train_episodes for s, a in zip(e.states, e.actions)}
    # sequences() orders valid entries time-major; rebuild the same order for the seen flags
    order = [(t, col) for t in range(seq["valid"].shape[0]) for col in range(seq["valid"].shape[1]) if valid[t, col]]
    flags = {}
    for col, e in enumerate(episodes):
        for t, (s, a) in enumerate(zip(e.states, e.actions)):
            if a != terminate:
                flags[(t, col)] = (s, a) in trained_pairs
    seen = np.array([flags[k] for k in order], bool) if order else np.zeros(0, bool)
    unseen = ~seen
    rules = seq["actions"][valid].numpy()
    sources = np.array([episodes[col].source for _, col in order])
    moved = np.abs(real) >= MOVED
    by_source = {source: pearson(predicted[sources == source], real[sources == source])
                 for source in sorted(set(sources.tolist()))}
    return {
        "heldout_episodes": len(episodes),
        "heldout_states": len(ids),
        "heldout_transitions": int(valid.sum()),
        "vae_reconstruction": float(recon.mean()),
        "vae_kl": float(kl.mean()),
        "mdn_nll": float(nll.mean()) if len(nll) else float("nan"),
        "reward_mse": float(np.mean((predicted - real) ** 2)) if len(real) else float("nan"),
        "reward_mae": float(np.mean(np.abs(predicted - real))) if len(real) else float("nan"),
        "reward_pearson": pearson(predicted, real),
        "reward_pearson_unseen": pearson(predicted[unseen], real[unseen]),
        "reward_spearman": spearman(predicted, real),
        "reward_spearman_moved": spearman(predicted[moved], real[moved]),
        "moved_transitions": int(moved.sum()),
        "zero_transitions": int((real == 0).sum()),
        "unseen_transitions": int(unseen.sum()),
        "reward_pearson_agent_location": pearson(predicted[~at_random], real[~at_random]),
        "agent_location_transitions": int((~at_random).sum()),
        "reward_pearson_random_location": pearson(predicted[at_random], real[at_random]),
        "reward_pearson_by_source": by_source,
        "random_location_transitions": int(at_random.sum()),
        "done_accuracy": float(np.mean(done_pred == done_real)) if len(real) else float("nan"),
        "mask_accuracy": float(np.mean(mask_pred == mask_real)),
        "mask_accuracy_seen_rules": float(np.mean(mask_pred[:, seen_rules] == mask_real[:, seen_rules])),
        "mask_exact": float(np.mean((mask_pred == mask_real).all(-1))),
        "mask_false_available": float(np.mean(mask_pred & ~mask_real)),
        "mask_false_unavailable": float(np.mean(~mask_pred & mask_real)),
        "reward_error_by_rule": error_by_rule(predicted, real, rules),
        "reward_pairs": {"predicted": predicted.tolist(), "real": real.tolist(), "seen": seen.tolist(),
                         "random_location": at_random.tolist(), "rule": rules.tolist()},
    }


def error_by_rule(predicted: np.ndarray, real: np.ndarray, rules: np.ndarray, top: int = 5) -> dict[str, float]:
    """Share of the squared reward error each rule carries, the `top` largest (rule name -> share): Pearson over a few
    hundred heavy-tailed rewards is mostly decided by a few large errors, and this says whose."""
    from rlflow.rewrites import RULES

    errors = (predicted - real) ** 2
    total = float(errors.sum())
    if not total:
        return {}
    shares = {int(r): float(errors[rules == r].sum()) / total for r in np.unique(rules)}
    best = sorted(shares, key=lambda r: -shares[r])[:top]
    return {RULES[r].name if r < len(RULES) else str(r): round(shares[r], 4) for r in best}


def ppo_curve(episodes: list[dict], window: int) -> tuple[np.ndarray, np.ndarray]:
    """PPO's rolling mean episode return (over `window` episodes) against real steps."""
    steps = np.array([e["real_steps"] for e in episodes], float)
    returns = np.array([e["return"] for e in episodes], float)
    window = max(1, min(window, len(returns)))
    smooth = np.convolve(returns, np.ones(window) / window, mode="valid")
    return steps[window - 1:], smooth


def ppo_line(ppo: dict | None) -> dict | None:
    """What `rlflow.plots.plot_sample_efficiency` draws of a PPO run (its ppo.json): the rolling mean over three
    passes through its models, its final mean return and its real steps; None without a run or a curve."""
    if not ppo or not ppo.get("curve"):
        return None
    window = 3 * len(ppo["config"]["models"])
    steps, mean_returns = ppo_curve(ppo["curve"], window)
    return {"steps": steps, "mean_returns": mean_returns, "window": window,
            "final_return": ppo["train"]["final_mean_return"], "real_steps": ppo["train"]["real_steps"]}


__all__ = ["pearson", "spearman", "encode_all", "quality", "ppo_curve", "ppo_line"]

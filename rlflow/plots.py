"""Every figure rlflow draws, and the one module that imports matplotlib.

The callers (the bench, the trainers) hand over plain data, lists, dicts and arrays, and a path: nothing here knows
a graph, a model or a trainer.  matplotlib is imported inside each function, with the Agg backend, so importing
rlflow never pays for it and no figure needs a display.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np


def _pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ------------------------------------------------------------------------------------------------ the bench
Interval = tuple[Sequence[float], Sequence[float], Sequence[float]]
"""Medians, lower and upper bounds, one of each per model (NaN where the method has no result for it)."""


def plot_bench_speedups(models: Sequence[str], speedups: dict[str, Interval], path: Path) -> None:
    """Per model and method: the median speedup and its interval, on an axis zoomed to the data (the differences are
    a few percent).  `speedups`: method -> its medians, lows and highs in the order of `models`."""
    plt = _pyplot()
    fig, ax = _bench_figure(plt, models)
    for k, (method, (ys, low, high)) in enumerate(speedups.items()):
        ys, low, high = np.asarray(ys, float), np.asarray(low, float), np.asarray(high, float)
        ax.errorbar(_offsets(len(models), k, len(speedups)), ys, yerr=[ys - low, high - ys], fmt="o", markersize=4,
                    capsize=2, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("speedup over ORT_ENABLE_ALL")
    ax.set_title("median and 95% interval; an input kept as it is scores exactly 1", fontsize=9)
    _finish_bench_figure(plt, fig, ax, models, path)


def plot_bench_times(models: Sequence[str], seconds: dict[str, Sequence[float]], path: Path) -> None:
    """Per model and method: the optimisation time as bars on a log scale.  `seconds`: method -> its times in the
    order of `models` (NaN where it has none)."""
    plt = _pyplot()
    fig, ax = _bench_figure(plt, models)
    for k, (method, values) in enumerate(seconds.items()):
        ax.bar(_offsets(len(models), k, len(seconds)), list(values), 0.8 / len(seconds), label=method)
    ax.set_yscale("log")
    ax.set_ylabel("optimisation time (s)")
    _finish_bench_figure(plt, fig, ax, models, path)


def _bench_figure(plt, models: Sequence[str]):
    return plt.subplots(figsize=(max(6, 1.2 * len(models) + 2), 4))


def _offsets(n_models: int, k: int, n_methods: int) -> np.ndarray:
    """x positions of the `k`-th of `n_methods` methods' marks beside each model's tick."""
    return np.arange(n_models) + (k - (n_methods - 1) / 2) * (0.8 / n_methods)


def _finish_bench_figure(plt, fig, ax, models: Sequence[str], path: Path) -> None:
    """Model names under the ticks, the legend beside the axes, and the file written atomically (a reader of the
    results folder during a run never sees half a picture)."""
    ax.set_xticks(np.arange(len(models)), models, rotation=30, ha="right")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


# --------------------------------------------------------------------------------------------- the trainers
def plot_learning_curve(episodes: list[dict], baseline: float | None, path: Path, title: str) -> None:
    """Mean episode return (rolling over one pass through the models) against real environment steps.

    `episodes`: in order, each with `real_steps`, `return` and `model`; `baseline`: a uniformly random policy's mean
    return (None: not drawn)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    if episodes:
        steps = np.array([e["real_steps"] for e in episodes])
        returns = np.array([e["return"] for e in episodes])
        window = max(1, min(len(returns), 3 * len({e["model"] for e in episodes})))
        kernel = np.ones(window) / window
        smooth = np.convolve(returns, kernel, mode="valid")
        ax.plot(steps, returns, ".", alpha=0.15, color="tab:blue", label="episode return")
        ax.plot(steps[window - 1:], smooth, color="tab:blue", label=f"mean of last {window} episodes")
        low = min(float(smooth.min()), baseline if baseline is not None else 0.0)
        clipped = int((returns < 1.5 * low - 5).sum())
        ax.set_ylim(1.5 * low - 5, max(float(returns.max()), 1.0) + 2)
        if clipped:
            ax.text(0.01, 0.02, f"{clipped} episodes below the axis", transform=ax.transAxes, fontsize=7)
    if baseline is not None:
        ax.axhline(baseline, color="tab:red", ls="--", label="uniformly random policy")
    ax.axhline(0.0, color="grey", lw=0.5)
    ax.set_xlabel("real environment steps")
    ax.set_ylabel("episode return (% of initial estimated runtime saved)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    _save(plt, fig, path)


def plot_sample_efficiency(wm_points: list[dict], ppo: dict | None, path: Path, title: str) -> None:
    """Mean real-environment return against real-environment steps: the world-model agent (greedy evaluations and
    its collection episodes) and model-free PPO.

    `wm_points`: one per iteration, each with `real_steps`, `eval_mean_return` and `collect_mean_return`.  `ppo`
    (None: no PPO line): `steps` and `mean_returns` (its rolling mean), `window` (episodes per mean),
    `final_return` and `real_steps` (its whole run's)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    if ppo is not None:
        ax.plot(ppo["steps"], ppo["mean_returns"], color="tab:blue",
                label=f"model-free PPO (mean of last {ppo['window']} episodes)")
        final = ppo["final_return"]
        ax.axhline(final, color="tab:blue", ls=":", lw=1, label=f"PPO final mean return {final:.2f}")
        ax.axvline(ppo["real_steps"] / 5, color="grey", ls="--", lw=1,
                   label=f"1/5 of PPO's real steps ({ppo['real_steps'] / 5:.0f})")
    if wm_points:
        x = [p["real_steps"] for p in wm_points]
        ax.plot(x, [p["eval_mean_return"] for p in wm_points], "o-", color="tab:red",
                label="world-model agent (greedy, one episode per model)")
        ax.plot(x, [p["collect_mean_return"] for p in wm_points], "x", color="tab:orange",
                label="world-model agent's collection episodes (mean per iteration)")
    ax.axhline(0.0, color="grey", lw=0.5)
    low = min([0.0] + [p["eval_mean_return"] for p in wm_points])
    ax.set_ylim(max(low - 3, -20), None)
    ax.set_xscale("log")
    ax.set_xlabel("real environment steps (log scale)")
    ax.set_ylabel("mean return (% of initial estimated runtime saved)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    _save(plt, fig, path)


def plot_world_model_quality(history: list[dict], final: dict, path: Path) -> None:
    """World-model quality: predicted against real reward on held-out transitions, and each figure per iteration.

    `history`: one dict of figures per iteration (`rlflow.train.worldmodel.quality.quality`'s keys and
    `iteration`), `final`: the last one, with its `reward_pairs` (`real`, `predicted`, `seen`); a missing figure is
    drawn as NaN."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(9, 7))
    ax = axes[0, 0]
    pairs = final.get("reward_pairs", {})
    if pairs.get("real"):
        real, pred = np.array(pairs["real"]), np.array(pairs["predicted"])
        seen = np.array(pairs["seen"], bool)
        ax.scatter(real[seen], pred[seen], s=10, alpha=0.5, label="(state, rule) also in training")
        ax.scatter(real[~seen], pred[~seen], s=14, alpha=0.8, marker="x", label="unseen (state, rule)")
        lo, hi = min(real.min(), pred.min()), max(real.max(), pred.max())
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.5)
        ax.legend(fontsize=7)
    ax.set_xlabel("real reward")
    ax.set_ylabel("predicted reward")
    ax.set_title(f"held-out transitions: Pearson {final.get('reward_pearson', math.nan):.3f} "
                 f"(unseen {final.get('reward_pearson_unseen', math.nan):.3f}), "
                 f"Spearman {final.get('reward_spearman', math.nan):.3f}", fontsize=9)
    its = [h.get("iteration", math.nan) for h in history]
    ax = axes[0, 1]
    ax.plot(its, [h.get("vae_reconstruction", math.nan) for h in history], "o-",
            label="V reconstruction (sum sq. error)")
    ax.plot(its, [h.get("vae_kl", math.nan) for h in history], "o-", label="V KL")
    ax.plot(its, [h.get("mdn_nll", math.nan) for h in history], "o-", label="M mixture NLL of z'")
    ax.set_xlabel("iteration")
    ax.legend(fontsize=7)
    ax.set_title("latent model on held-out states", fontsize=9)
    ax = axes[1, 0]
    ax.plot(its, [h.get("reward_pearson", math.nan) for h in history], "o-", label="reward Pearson")
    ax.plot(its, [h.get("reward_pearson_unseen", math.nan) for h in history], "o-", label="reward Pearson (unseen)")
    ax.plot(its, [h.get("reward_spearman", math.nan) for h in history], "o-", label="reward Spearman (ranks)")
    if any("reward_pearson_agent_location" in h for h in history):
        ax.plot(its, [h.get("reward_pearson_agent_location", math.nan) for h in history], "o-", color="tab:cyan",
                label="reward Pearson (rule at the scorer's match)")
        ax.plot(its, [h.get("location_pearson", math.nan) for h in history], "o:", color="tab:purple",
                label="location scorer Pearson")
    ax.plot(its, [h.get("done_accuracy", math.nan) for h in history], "o-", label="termination accuracy")
    ax.axhline(0.8, color="grey", ls="--", lw=0.5)
    ax.set_ylim(-0.1, 1.05)
    ax.set_xlabel("iteration")
    ax.legend(fontsize=6, loc="lower right")
    ax.set_title("reward and termination", fontsize=9)
    ax2 = ax.twinx()
    ax2.plot(its, [h.get("reward_mae", math.nan) for h in history], "s--", color="tab:red", label="reward MAE")
    ax2.set_ylabel("reward MAE", fontsize=8)
    ax = axes[1, 1]
    ax.plot(its, [h.get("mask_accuracy", math.nan) for h in history], "o-", label="per rule (all rules)")
    ax.plot(its, [h.get("mask_accuracy_seen_rules", math.nan) for h in history], "o-",
            label="per rule (rules ever available)")
    ax.plot(its, [h.get("mask_exact", math.nan) for h in history], "o-", label="whole mask right")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("iteration")
    ax.legend(fontsize=7)
    ax.set_title("predicted rule availability (the dream's action mask)", fontsize=9)
    _save(plt, fig, path)


def _save(plt, fig, path: Path) -> None:
    """The figure, laid out, to `path` (its folder created), then closed."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)

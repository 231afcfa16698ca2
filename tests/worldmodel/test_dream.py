"""The dream environment: Gymnasium conformance, no real graph, temperature."""
from __future__ import annotations

import numpy as np
import torch
from gymnasium.utils.env_checker import check_env

from rlflow.worldmodel.dream import DreamBatch, DreamEnv
from rlflow.worldmodel.mdrnn import MDRNN


def _model(seed=0):
    torch.manual_seed(seed)
    model = MDRNN(latent_size=8, n_actions=6, n_rules=5, hidden=16, gaussians=3)
    with torch.no_grad():  # every rule predicted available, termination unlikely: long dreams
        model.mask_head[-1].bias.fill_(5.0)
        model.done_head[-1].bias.fill_(-5.0)
    return model


def test_dream_env_passes_check_env():
    env = DreamEnv(_model(), torch.randn(3, 8), torch.zeros(3, 8), max_episode_steps=6)
    check_env(env, skip_render_check=True)
    obs, info = env.reset(seed=1)
    assert obs.shape == (8 + 16,) and info["action_mask"].dtype == np.int8 and info["action_mask"][-1] == 1
    again, _ = env.reset(seed=1)
    assert np.array_equal(obs, again)


def test_dream_runs_after_the_real_env_is_closed(tiny_model, wm_cost_model):
    """The dream is built from latents only: closing (and deleting) the real environment changes nothing."""
    import gymnasium as gym

    import rlflow.env  # noqa: F401 - registers rlflow/Rewrite-v0

    real = gym.make("rlflow/Rewrite-v0", model=tiny_model, cost_model=wm_cost_model, max_nodes=128, max_edges=256,
                    max_candidates=32)
    real.reset(seed=0)
    real.close()
    del real
    env = DreamEnv(_model(), torch.randn(2, 8), torch.zeros(2, 8), max_episode_steps=5)
    obs, info = env.reset(seed=0)
    total, done, steps = 0.0, False, 0
    while not done:
        action = int(np.flatnonzero(info["action_mask"][:-1])[0])
        obs, reward, terminated, truncated, info = env.step(action)
        total, done, steps = total + reward, terminated or truncated, steps + 1
    assert steps == 5 and np.isfinite(total)


def test_temperature_changes_the_spread_of_dreamed_states():
    model = _model()
    start = torch.zeros(1, 8)

    def spread(temperature):
        batch = DreamBatch(model, start, torch.zeros(1, 8), 256, temperature=temperature, max_episode_steps=50,
                           seed=0)
        batch.reset()
        batch.step(torch.zeros(256, dtype=torch.long))
        return float(batch.z.std(0).mean())

    assert spread(0.0) < 1e-6 < spread(0.5) < spread(2.0)


def test_masked_and_terminate_actions():
    model = _model()
    with torch.no_grad():
        model.mask_head[-1].bias[2] = -50.0  # rule 2 never available
        model.mask_head[-1].weight[2] = 0.0
    batch = DreamBatch(model, torch.zeros(1, 8), torch.zeros(1, 8), 2, max_episode_steps=10, invalid_penalty=-1.0,
                       seed=0)
    batch.reset()
    assert not batch.action_mask()[:, 2].any() and batch.action_mask()[:, -1].all()
    rewards, terminated, truncated, info = batch.step(torch.tensor([2, 5]))
    assert rewards[0] == -1.0 and info["invalid"][0] and terminated.tolist() == [False, True]

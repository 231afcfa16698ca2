"""The dream environment: Gymnasium conformance, no real graph, temperature."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env

from rlflow.train.worldmodel.dream import DreamBatch, DreamEnv
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

    import rlflow.env.rewrite_env  # noqa: F401 - registers rlflow/Rewrite-v0

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


def test_dream_pays_a_pessimistic_reward_clipped_per_rule():
    """Ensemble mean minus penalty times spread, then clipped to each rule's range (MOPO-style pessimism)."""
    model = _model()
    with torch.no_grad():
        for k, head in enumerate(model.reward_heads):  # members predict 0, 1, 2, 3, 4 (scaled units) whatever the input
            for p in head.parameters():
                p.zero_()
            head[-1].bias.fill_(float(k))
    members = torch.arange(5.0)
    mean, std = float(members.mean()), float(members.std(unbiased=False))
    high = torch.tensor([100.0, 100.0, 1.5, 100.0, 100.0])
    batch = DreamBatch(model, torch.zeros(1, 8), torch.zeros(1, 8), 3, reward_scale=10.0, reward_penalty=0.5,
                       reward_range=(-100.0, high), temperature=0.0, seed=0)
    batch.reset()
    rewards, *_ = batch.step(torch.tensor([0, 2, 5]))
    assert rewards[0].item() == pytest.approx(10 * (mean - 0.5 * std), rel=1e-5)
    assert rewards[1].item() == pytest.approx(1.5) and rewards[2].item() == 0.0


def test_dreams_start_from_real_states_with_their_hidden_state_and_steps():
    from rlflow.train.worldmodel.dream import real_starts
    from rlflow.train.worldmodel.replay import Episode

    model = _model()
    mu, logvar = torch.randn(6, 8), torch.zeros(6, 8)
    episodes = [Episode("a", states=[0, 1, 2, 3], actions=[0, 1, 5], rewards=[0.0, 0.0, 0.0]),
                Episode("b", states=[0, 4, 5], actions=[2, 3], rewards=[0.0, 0.0])]
    starts = real_starts(model, episodes, mu, logvar)
    assert starts["steps"].tolist() == [0, 0, 1, 1, 2] and starts["first"].tolist() == [True, True, False, False, False]
    assert starts["episode"].tolist() == [0, 1, 0, 1, 0]
    assert torch.equal(starts["mu"][2], mu[1]) and torch.equal(starts["mu"][4], mu[2])
    assert starts["h"][:2].abs().sum() == 0 and starts["h"][2:].abs().sum() > 0
    # a dream started at step 2 of a 4-step limit is truncated after 2 steps; the horizon caps it further
    batch = DreamBatch(model, starts["mu"][4:], starts["logvar"][4:], 1, max_episode_steps=4,
                       start_state=(starts["h"][4:], starts["c"][4:]), start_steps=starts["steps"][4:], seed=0)
    batch.reset()
    assert torch.equal(batch.h, starts["h"][4:])
    _, _, truncated, _ = batch.step(torch.tensor([0]))
    _, _, truncated2, _ = batch.step(torch.tensor([0]))
    assert not truncated[0] and truncated2[0]
    capped = DreamBatch(model, starts["mu"], starts["logvar"], 2, max_episode_steps=50, horizon=1, seed=0)
    capped.reset()
    assert capped.step(torch.tensor([0, 1]))[2].all()


def test_dream_returns_are_capped_per_start():
    """A rewrite that the model thinks pays every time cannot earn more than its start's cap in one episode."""
    model = _model()
    with torch.no_grad():
        for head in model.reward_heads:
            for p in head.parameters():
                p.zero_()
            head[-1].bias.fill_(1.0)  # +10 per step at reward_scale 10
    batch = DreamBatch(model, torch.zeros(2, 8), torch.zeros(2, 8), 2, reward_scale=10.0, temperature=0.0,
                       start_caps=torch.tensor([25.0, 25.0]), max_episode_steps=50, seed=0)
    batch.reset()
    paid = [batch.step(torch.tensor([0, 0]))[0] for _ in range(4)]
    assert [float(p[0]) for p in paid] == [10.0, 10.0, 5.0, 0.0]

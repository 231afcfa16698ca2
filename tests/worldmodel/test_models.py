"""V (VAE over the graph embedding) and M (MDN-RNN): shapes, losses, shared weights."""
from __future__ import annotations

import math

import pytest
import torch

from rlflow.worldmodel.mdrnn import MDRNN, MDRNNCell, gmm_loss, mdrnn_loss, sample_gmm, symexp, symlog
from rlflow.worldmodel.vae import VAE, kl_divergence, vae_loss


def test_vae_shapes_kl_nonnegative_and_training_reduces_loss():
    torch.manual_seed(0)
    vae = VAE(16, 4, 32)
    x = torch.randn(64, 16)
    recon, mu, logvar, z = vae(x)
    assert recon.shape == (64, 16) and mu.shape == logvar.shape == z.shape == (64, 4)
    assert (kl_divergence(mu, logvar) >= 0).all()
    assert kl_divergence(torch.zeros(3, 4), torch.zeros(3, 4)).abs().max() < 1e-6
    opt = torch.optim.Adam(vae.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        recon, mu, logvar, _ = vae(x)
        loss, rec, kl = vae_loss(recon, x, mu, logvar)
        assert kl >= 0
        first = float(loss) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.8 * first
    vae.eval()
    assert torch.equal(vae(x)[3], vae.encode(x)[0])  # evaluation takes the mean


def test_gmm_loss_equals_a_hand_computed_single_gaussian_nll():
    z = torch.tensor([[0.5, -1.0]])
    mu = torch.tensor([[[0.0, 0.0]]])
    sigma = torch.tensor([[[1.0, 2.0]]])
    logpi = torch.zeros(1, 1)
    expected = sum(0.5 * math.log(2 * math.pi) + math.log(s) + 0.5 * ((x - m) / s) ** 2
                   for x, m, s in ((0.5, 0.0, 1.0), (-1.0, 0.0, 2.0)))
    assert float(gmm_loss(z, mu, sigma, logpi)) == pytest.approx(expected, rel=1e-6)
    # two identical components with weights 1/2 each are the same single Gaussian
    two = gmm_loss(z, mu.repeat(1, 2, 1), sigma.repeat(1, 2, 1), torch.log(torch.full((1, 2), 0.5)))
    assert float(two) == pytest.approx(expected, rel=1e-6)


def test_mdrnn_sequence_and_cell_agree_with_shared_weights():
    torch.manual_seed(0)
    model = MDRNN(latent_size=6, n_actions=5, n_rules=4, hidden=16, gaussians=3)
    cell = MDRNNCell(model)
    assert {id(p) for p in cell.parameters()} == {id(p) for p in model.parameters()}
    t, b = 7, 3
    actions = torch.randint(0, 5, (t, b))
    latents = torch.randn(t, b, 6)
    seq = model(actions, latents)
    state = model.initial_state(b)
    for step in range(t):
        out, state = cell(actions[step], latents[step], state)
        for name in ("mus", "sigmas", "logpi", "reward", "done_logit", "mask_logits", "reward_std", "reward_members"):
            assert torch.allclose(getattr(out, name), getattr(seq, name)[step], atol=1e-5), name
    assert seq.mus.shape == (t, b, 3, 6) and seq.mask_logits.shape == (t, b, 4)
    assert seq.reward_members.shape == (t, b, 5) and torch.allclose(seq.reward, seq.reward_members.mean(-1))
    assert (seq.reward_std >= 0).all()


def test_mdrnn_loss_is_finite_and_training_reduces_it():
    torch.manual_seed(0)
    model = MDRNN(latent_size=4, n_actions=3, n_rules=2, hidden=16, gaussians=2)
    t, b = 5, 8
    actions = torch.randint(0, 2, (t, b))
    latents = torch.randn(t, b, 4)
    next_latents = latents + 0.1
    rewards, dones = torch.randn(t, b), torch.zeros(t, b)
    masks, valid = torch.ones(t, b, 2), torch.ones(t, b)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = mdrnn_loss(model(actions, latents), next_latents, rewards, dones, masks, valid)["loss"]
        losses.append(float(loss))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


def test_the_random_location_bit_tells_m_apart_two_rewards_of_one_rule():
    """The same (z, rule) pays +1 at the agent's chosen match and -1 at random ones: with the bit M learns both, the
    cell (the dream, bit 0 by default) predicts the agent's reward, and sequence and cell still agree."""
    torch.manual_seed(0)
    model = MDRNN(latent_size=4, n_actions=3, n_rules=2, hidden=16, gaussians=1, location_flag=True)
    t, b = 1, 64
    actions, latents = torch.ones(t, b, dtype=torch.long), torch.zeros(t, b, 4)
    flags = (torch.arange(b) % 2).float().expand(t, b)
    rewards = 1.0 - 2.0 * flags
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(200):
        out = model(actions, latents, flags=flags)
        loss = mdrnn_loss(out, latents, rewards, torch.zeros(t, b), torch.ones(t, b, 2), torch.ones(t, b))["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        chosen, _ = MDRNNCell(model)(torch.ones(1, dtype=torch.long), torch.zeros(1, 4), model.initial_state(1))
        at_random, _ = MDRNNCell(model)(torch.ones(1, dtype=torch.long), torch.zeros(1, 4), model.initial_state(1),
                                        torch.ones(1))
        seq = model(actions, latents, flags=flags)
    assert float(chosen.reward) == pytest.approx(1.0, abs=0.1)
    assert float(at_random.reward) == pytest.approx(-1.0, abs=0.1)
    assert torch.allclose(seq.reward[0, 0], chosen.reward[0], atol=1e-5)
    assert torch.allclose(seq.reward[0, 1], at_random.reward[0], atol=1e-5)
    assert MDRNN(4, 3, 2, location_flag=True).spec()["location_flag"] is True


def test_temperature_changes_sampling_spread():
    torch.manual_seed(0)
    mus = torch.zeros(4000, 2, 3)
    mus[:, 1] = 5.0
    sigmas = torch.ones(4000, 2, 3)
    logpi = torch.log(torch.tensor([[0.8, 0.2]])).expand(4000, 2)
    gen = torch.Generator().manual_seed(0)
    cold = sample_gmm(mus, sigmas, logpi, 0.1, gen)
    hot = sample_gmm(mus, sigmas, logpi, 1.5, gen)
    assert hot.std() > cold.std()
    assert torch.equal(sample_gmm(mus, sigmas, logpi, 0.0), torch.zeros(4000, 3))


def test_a_markov_reward_reads_the_state_and_action_but_not_the_history():
    """With `markov_reward`, one (z, action) earns the same predicted reward whatever the LSTM's state (its history);
    without it the history changes the reward; the option is part of the spec."""
    torch.manual_seed(0)
    z, action = torch.randn(1, 4), torch.ones(1, dtype=torch.long)
    history = (torch.randn(1, 16), torch.randn(1, 16))
    for markov in (True, False):
        model = MDRNN(latent_size=4, n_actions=3, n_rules=2, hidden=16, gaussians=1, markov_reward=markov)
        with torch.no_grad():
            fresh, _ = MDRNNCell(model)(action, z, model.initial_state(1))
            later, _ = MDRNNCell(model)(action, z, history)
        assert (float(fresh.reward) == pytest.approx(float(later.reward))) is markov
        assert (float(fresh.done_logit) == pytest.approx(float(later.done_logit))) is False  # the rest still reads h
        assert model.spec()["markov_reward"] is markov


def test_bootstrapped_reward_members_each_learn_their_own_episodes():
    """With member weights, a reward member learns only from the episodes it was dealt: two episodes take the same
    rule from the same latent and earn +1 and -1; the member dealt the first predicts about +1, the one dealt the
    second about -1, and their mean sits between (unweighted, both would learn 0)."""
    torch.manual_seed(0)
    model = MDRNN(latent_size=4, n_actions=3, n_rules=2, hidden=16, gaussians=1, reward_ensemble=2,
                  markov_reward=True)
    z = torch.randn(1, 1, 4).expand(1, 2, 4)  # (T=1, B=2, Z): one state, two episodes
    actions, rewards = torch.ones(1, 2, dtype=torch.long), torch.tensor([[1.0, -1.0]])
    ones, weights = torch.ones(1, 2), torch.eye(2)  # member 0 sees episode 0, member 1 episode 1
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        out = model(actions, z)
        loss = mdrnn_loss(out, z, rewards, torch.zeros(1, 2), torch.ones(1, 2, 2), ones, member_weights=weights)
        opt.zero_grad()
        loss["loss"].backward()
        opt.step()
    members = model(actions, z).reward_members[0, 0].detach()
    assert float(members[0]) == pytest.approx(1.0, abs=0.1) and float(members[1]) == pytest.approx(-1.0, abs=0.1)


def test_a_description_of_the_random_match_lets_m_tell_apart_what_two_matches_earn():
    """At random matches one (z, rule) earns +1 where the match is described by +1 and -1 where by -1: an M that
    reads the description learns both, one that reads only the bit learns their mean; an own step (bit 0, the
    dream's kind) ignores any description, and a description of the wrong width is refused."""
    torch.manual_seed(0)
    t, b = 1, 64
    actions, latents = torch.ones(t, b, dtype=torch.long), torch.zeros(t, b, 4)
    sign = 1.0 - 2.0 * (torch.arange(b) % 2).float()
    described = torch.stack([torch.ones(b), sign], -1).expand(t, b, 2)  # bit 1, then the description
    predictions = {}
    for width in (0, 1):
        model = MDRNN(latent_size=4, n_actions=3, n_rules=2, hidden=16, gaussians=1, location_flag=True,
                      match_features=width)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        flags = described if width else described[..., 0]
        for _ in range(200):
            out = model(actions, latents, flags=flags)
            loss = mdrnn_loss(out, latents, sign.expand(t, b), torch.zeros(t, b), torch.ones(t, b, 2),
                              torch.ones(t, b))["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            predictions[width] = model(actions, latents, flags=flags).reward[0]
    assert torch.allclose(predictions[1], sign, atol=0.15)
    assert predictions[0].abs().max() < 0.2
    assert model.encode_action(torch.ones(2, dtype=torch.long)).shape == (2, 3 + 1)  # the bit; the rest: reward only
    with torch.no_grad():  # an own step (bit 0) reads no description: whatever is passed, the same prediction
        own = model(actions, latents, flags=torch.zeros(t, b, 2)).reward
        described_own = model(actions, latents, flags=torch.cat([torch.zeros(t, b, 1), described[..., 1:]], -1))
    assert torch.equal(own, described_own.reward)
    with pytest.raises(ValueError, match="reads 2"):
        model(actions, latents, flags=torch.zeros(t, b, 3))
    with pytest.raises(ValueError, match="needs location_flag"):
        MDRNN(4, 3, 2, match_features=1)


def test_symlog_is_undone_by_symexp_and_is_the_identity_without_a_knee():
    rewards = torch.tensor([-3.0, -0.05, 0.0, 0.001, 0.1, 2.5])
    assert torch.allclose(symexp(symlog(rewards, 0.1), 0.1), rewards, atol=1e-6)
    assert torch.equal(symlog(rewards, 0.0), rewards) and torch.equal(symexp(rewards, 0.0), rewards)
    # below the knee about r/knee, far above it logarithmic: 30x the reward is not 30x the target
    assert float(symlog(torch.tensor(0.001), 0.1)) == pytest.approx(0.01, rel=0.01)
    assert float(symlog(torch.tensor(3.0), 0.1)) < 5 * float(symlog(torch.tensor(0.1), 0.1))
    assert torch.isfinite(symexp(torch.tensor([1e4, -1e4]), 0.1)).all()  # a head far outside its range


def test_with_a_knee_the_heads_learn_symlog_rewards_and_m_reports_rewards():
    """With `reward_knee` the members' outputs are targets in symlog space: M's rewards (members, mean, spread) are
    those targets turned back, and the loss's reward term compares the targets with the symlog of the real rewards
    (zero where they agree), not the rewards themselves."""
    torch.manual_seed(0)
    t, b = 2, 3
    model = MDRNN(latent_size=4, n_actions=3, n_rules=2, hidden=16, gaussians=1, reward_ensemble=3, reward_knee=0.1)
    actions, latents = torch.randint(0, 3, (t, b)), torch.randn(t, b, 4)
    out = model(actions, latents)
    assert out.reward_knee == 0.1  # the loss reads the knee from the output, so it cannot be given another
    assert torch.allclose(out.reward_members, symexp(out.reward_targets, 0.1))
    assert torch.allclose(out.reward, out.reward_members.mean(-1))
    assert torch.allclose(out.reward_std, out.reward_members.std(-1, unbiased=False))
    assert model.spec()["reward_knee"] == 0.1
    args = (latents, None, torch.zeros(t, b), torch.ones(t, b, 2), torch.ones(t, b))
    exact = symexp(out.reward_targets.mean(-1), 0.1)  # rewards whose symlog is the members' mean
    members_apart = out.reward_targets.var(-1, unbiased=False).mean()  # the members' own spread around it
    with torch.no_grad():
        fitted = mdrnn_loss(out, args[0], exact, *args[2:])
        shifted = mdrnn_loss(out, args[0], exact + 1.0, *args[2:])
        no_reward = mdrnn_loss(out._replace(reward_targets=torch.zeros_like(out.reward_targets)), args[0],
                               torch.zeros(t, b), *args[2:])
    z = latents.shape[-1]
    assert float(fitted["loss"] - no_reward["loss"]) == pytest.approx(float(members_apart) / (z + 2), rel=1e-4)
    assert float(shifted["loss"]) > float(fitted["loss"])

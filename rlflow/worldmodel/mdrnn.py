"""M: the MDN-RNN that learns how a rewrite changes the latent graph state, what it earns and whether the episode ends.

As in ctallec/world-models: an LSTM reads (z_t, action_t) and a mixture-density head gives a mixture of K diagonal
Gaussians over z_{t+1}, plus the reward and a termination logit.  `MDRNN` runs whole sequences (training) and
`MDRNNCell` one step (the dream and real rollouts); the cell holds the sequence model itself, so the two share every
weight by construction.

Actions are rule ids (`0..R-1`: apply one match of that rule) and `R` (terminate), one-hot encoded: the dream acts
over rule types, so it needs no candidate list from a real graph.  With `location_flag` the action also carries one
bit: the rule was applied at a random match (exploration) rather than where the agent's location scorer chose
(`rlflow.worldmodel.location`); where a rule goes changes what it earns, and the dream always plays the agent's own
choice (bit 0), so M learns both kinds of real transition without mistaking one for the other.  With
`match_features` > 0 a random match is also described: that many numbers from the location scorer
(`rlflow.worldmodel.location.match_descriptors`: its rating of the match, and optionally its embedding of the
matched nodes).  Which match a random step took decides much of what it earned (on mobilenet-v2-tiny one
group-convolution merge pays and another costs), and without the description M can only predict the average over
matches.  The description reaches the reward alone, as a correction that only random steps get (`match_heads`,
times the bit): everything else, and the reward of the agent's own steps (the dream's), reads what it reads without
one.  Fed to the whole model instead, the description made the agent's own steps (described by zeros, a point the
random steps never visit) a far extrapolation: on seed 2, M predicted -2.0 for bert-base-tiny's first attention
fusion (real +2.8) and the controller learned to stop at once.  What a real candidate list would say is predicted
too: `mask_logits(z_t, h_t)` gives the per-rule availability (does the graph have a match of rule r?) of
the state (z_t, h_t), which is the action mask the dream hands to the controller.  The heads read the LSTM output
together with z_t and the action (a skip connection: reward is mostly a function of the graph and the rule, which
the LSTM need not relay).

The reward is predicted by an ensemble of `reward_ensemble` regression heads (different initialisations, each
trained on every transition, or with `mdrnn_loss(member_weights=...)` on its own share of the episodes: bagging):
their mean is the prediction and their spread (`reward_std`) says where the model does not know, which the dream
turns into a penalty (MOPO) so that the controller cannot exploit the model's errors. With `markov_reward` the
reward heads read only z_t and the action: the environment is Markov in the graph, and a head that also reads the
LSTM's history can tell training episodes apart by it and learn their rewards by heart (reward Pearson 0.99 on
training episodes against 0.55 on held-out ones).  With `reward_knee` the heads learn sign(r)·log(1 + |r|/knee)
(`symlog`, as DreamerV3 does) and their outputs are turned back into rewards before the mean and spread are taken:
rewards are heavy-tailed (an attention fusion saves 20% of the runtime, most rewrites under 1%), and a squared error
on the rewards themselves spends M on the few large ones, leaving the order of the many small ones to chance (with
the knee, M ranks held-out rewards better at little cost in Pearson).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class MDRNNOutput(NamedTuple):
    """Predictions for each step (leading dims L = (T, B) for sequences, (B,) for the cell; K Gaussians, Z latent)."""

    mus: torch.Tensor  # (*L, K, Z)
    sigmas: torch.Tensor  # (*L, K, Z)
    logpi: torch.Tensor  # (*L, K) log mixture weights
    reward: torch.Tensor  # (*L,) predicted reward of the step (in reward units / reward_scale)
    done_logit: torch.Tensor  # (*L,) termination after the step (no rewrite left)
    mask_logits: torch.Tensor  # (*L, R) per-rule availability of the state *before* the step (z_t, h_t)
    reward_std: torch.Tensor  # (*L,) spread of the reward ensemble (same units as reward)
    reward_members: torch.Tensor  # (*L, E) each ensemble member's reward
    reward_targets: torch.Tensor  # (*L, E) what the members output: their reward through `symlog` (the loss's space)
    reward_knee: float = 0.0  # the model's `reward_knee`: `mdrnn_loss` compares targets in the same symlog space


def symlog(reward: torch.Tensor, knee: float) -> torch.Tensor:
    """sign(r)·log(1 + |r|/knee): about r/knee below the knee, logarithmic above it; `reward` itself when knee is 0."""
    return torch.sign(reward) * torch.log1p(reward.abs() / knee) if knee else reward


def symexp(target: torch.Tensor, knee: float) -> torch.Tensor:
    """The inverse of `symlog` (targets clamped at +-20 so that a head extrapolating in the dream stays finite)."""
    return torch.sign(target) * knee * torch.expm1(target.abs().clamp(max=20.0)) if knee else target


def gmm_loss(batch: torch.Tensor, mus: torch.Tensor, sigmas: torch.Tensor, logpi: torch.Tensor,
             reduce: bool = True) -> torch.Tensor:
    """Negative log-likelihood of `batch` under a mixture of diagonal Gaussians (ctallec/world-models' gmm_loss).

    Args:
        batch: (*L, Z) observed next latents.
        mus: (*L, K, Z) component means.
        sigmas: (*L, K, Z) component standard deviations (> 0).
        logpi: (*L, K) log mixture weights (log-softmax normalised).
        reduce: mean over the leading dims if True, else the per-element NLL (*L,).

    Returns:
        - log sum_k pi_k prod_z N(batch_z; mu_kz, sigma_kz), computed with torch.logsumexp for stability.
    """
    batch = batch.unsqueeze(-2)  # (*L, 1, Z)
    normal = torch.distributions.Normal(mus, sigmas)
    log_probs = logpi + normal.log_prob(batch).sum(-1)  # (*L, K)
    nll = -torch.logsumexp(log_probs, dim=-1)
    return nll.mean() if reduce else nll


class MDRNN(nn.Module):
    """The sequence model.

    Args:
        latent_size: size of z (Z).
        n_actions: number of actions (rules plus terminate); actions enter one-hot.
        n_rules: rules of the availability head (R).
        hidden: LSTM size (H).
        gaussians: mixture components (K).
        reward_ensemble: reward heads (E).
        location_flag: the action carries the random-location bit (see the module docstring).
        markov_reward: the reward heads read z_t and the action only, not the LSTM's history (see the module
            docstring).
        match_features: numbers describing a random match, after the bit (needs `location_flag`; see the module
            docstring).
        reward_knee: > 0: the reward heads learn `symlog(reward, reward_knee)` (in reward units / reward_scale);
            0: the reward itself (see the module docstring).
    """

    def __init__(self, latent_size: int, n_actions: int, n_rules: int, hidden: int = 128, gaussians: int = 5,
                 reward_ensemble: int = 5, location_flag: bool = False, markov_reward: bool = False,
                 match_features: int = 0, reward_knee: float = 0.0):
        super().__init__()
        if reward_ensemble < 1:
            raise ValueError("reward_ensemble must be >= 1")
        if match_features and not location_flag:
            raise ValueError("match_features needs location_flag")
        self.latent_size, self.n_actions, self.n_rules = latent_size, n_actions, n_rules
        self.hidden, self.gaussians, self.reward_ensemble = hidden, gaussians, reward_ensemble
        self.location_flag, self.markov_reward = bool(location_flag), bool(markov_reward)
        self.match_features = int(match_features)
        if reward_knee < 0:
            raise ValueError("reward_knee must be >= 0")
        self.reward_knee = float(reward_knee)
        action_size = n_actions + int(self.location_flag)
        self.rnn = nn.LSTM(latent_size + action_size, hidden)
        head_in = hidden + latent_size + action_size
        self.gmm_linear = nn.Linear(head_in, (2 * latent_size + 1) * gaussians)
        reward_in = latent_size + action_size if self.markov_reward else head_in
        self.reward_heads = nn.ModuleList(nn.Sequential(nn.Linear(reward_in, hidden), nn.ReLU(), nn.Linear(hidden, 1))
                                          for _ in range(reward_ensemble))
        self.match_heads = nn.ModuleList(
            nn.Sequential(nn.Linear(reward_in + self.match_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
            for _ in range(reward_ensemble if self.match_features else 0))
        self.done_head = nn.Sequential(nn.Linear(head_in, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.mask_head = nn.Sequential(nn.Linear(latent_size + hidden, hidden), nn.ReLU(), nn.Linear(hidden, n_rules))

    def spec(self) -> dict:
        """Constructor arguments (stored in checkpoints)."""
        return {"latent_size": self.latent_size, "n_actions": self.n_actions, "n_rules": self.n_rules,
                "hidden": self.hidden, "gaussians": self.gaussians, "reward_ensemble": self.reward_ensemble,
                "location_flag": self.location_flag, "markov_reward": self.markov_reward,
                "match_features": self.match_features, "reward_knee": self.reward_knee}

    def initial_state(self, batch: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero (h, c), each (B, H)."""
        zeros = torch.zeros(batch, self.hidden, device=device)
        return zeros, zeros.clone()

    def encode_action(self, actions: torch.Tensor, flags: torch.Tensor | None = None) -> torch.Tensor:
        """(*L,) action ids and random-location bits (`location`) -> (*L, A) inputs, or (*L, A + 1) with
        `location_flag`."""
        return self._action_input(actions, self.location(actions, flags))

    def _action_input(self, actions: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        """`encode_action` from the steps' `location` (computed once for the LSTM and the reward)."""
        onehot = F.one_hot(actions.long(), self.n_actions).float()
        return torch.cat([onehot, where[..., :1]], -1) if self.location_flag else onehot

    def location(self, actions: torch.Tensor, flags: torch.Tensor | None) -> torch.Tensor:
        """(*L, 1 + F): each step's random-location bit, then the description of its match (F =
        `match_features`).

        `flags`: None (the agent's own location everywhere, as in the dream), (*L,) random-location bits (no match
        described: zeros) or (*L, 1 + F) bits followed by the match descriptions."""
        width = 1 + self.match_features
        where = torch.zeros(*actions.shape, width)
        if flags is not None:
            flags = flags.float()
            if flags.dim() == actions.dim():
                where[..., 0] = flags
            elif flags.shape[-1] == width:
                where = flags
            else:
                raise ValueError(f"location input has {flags.shape[-1]} numbers, this model reads {width}")
        return where

    def mask_logits(self, latents: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Per-rule availability logits (*L, R) of the state (z, h): latents (*L, Z), h (*L, H)."""
        return self.mask_head(torch.cat([latents, h], -1))

    def _heads(self, outs: torch.Tensor, latents: torch.Tensor, onehot: torch.Tensor, where: torch.Tensor):
        """outs (*L, H), latents (*L, Z), onehot (*L, A), where (*L, 1 + F) (`location`) -> mus, sigmas, logpi,
        done_logit, the reward heads' outputs (*L, E) (`reward_targets`: symlog space with a knee)."""
        x = torch.cat([outs, latents, onehot], -1)
        gmm = self.gmm_linear(x)
        k, z = self.gaussians, self.latent_size
        lead = gmm.shape[:-1]
        mus = gmm[..., : k * z].reshape(*lead, k, z)
        sigmas = gmm[..., k * z: 2 * k * z].reshape(*lead, k, z).clamp(-7.0, 5.0).exp()
        logpi = F.log_softmax(gmm[..., 2 * k * z:], dim=-1)
        reward_x = torch.cat([latents, onehot], -1) if self.markov_reward else x
        members = torch.cat([head(reward_x) for head in self.reward_heads], -1)
        if self.match_features:
            described = torch.cat([reward_x, where[..., 1:]], -1)
            members = members + where[..., :1] * torch.cat([head(described) for head in self.match_heads], -1)
        return mus, sigmas, logpi, self.done_head(x).squeeze(-1), members

    def _output(self, heads, mask_logits: torch.Tensor) -> MDRNNOutput:
        mus, sigmas, logpi, done, targets = heads
        members = symexp(targets, self.reward_knee)
        return MDRNNOutput(mus, sigmas, logpi, members.mean(-1), done, mask_logits, members.std(-1, unbiased=False),
                           members, targets, self.reward_knee)

    def forward(self, actions: torch.Tensor, latents: torch.Tensor,
                state: tuple[torch.Tensor, torch.Tensor] | None = None,
                flags: torch.Tensor | None = None) -> MDRNNOutput:
        """Predictions for a batch of sequences.

        Args:
            actions: (T, B) long action ids.
            latents: (T, B, Z) z_t.
            state: initial (h, c), each (B, H); zeros when None.
            flags: (T, B) random-location bits or (T, B, 1 + F) bits and match descriptions (`encode_action`;
                zeros when None; ignored without `location_flag`).

        Returns:
            `MDRNNOutput` with leading dims (T, B); `mask_logits[t]` is the availability of state t, read from z_t
            and the hidden state h_t before step t (h_0 = the initial state).
        """
        t, b = actions.shape
        if state is None:
            state = self.initial_state(b, latents.device)
        where = self.location(actions, flags)
        onehot = self._action_input(actions, where)
        outs, _ = self.rnn(torch.cat([latents, onehot], -1), (state[0].unsqueeze(0), state[1].unsqueeze(0)))
        before = torch.cat([state[0].unsqueeze(0), outs[:-1]], 0)  # h_t for each t
        return self._output(self._heads(outs, latents, onehot, where), self.mask_logits(latents, before))


class MDRNNCell(nn.Module):
    """One step of an `MDRNN`, with the very same weights (it holds the sequence model).

    Args:
        mdrnn: the trained sequence model.
    """

    def __init__(self, mdrnn: MDRNN):
        super().__init__()
        self.mdrnn = mdrnn

    def forward(self, action: torch.Tensor, latent: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                flag: torch.Tensor | None = None):
        """One step: action (B,) long, latent (B, Z), state (h, c) each (B, H), flag (B,) random-location bits or
        (B, 1 + F) bits and match descriptions (zeros when None: the agent's own location, as in the dream) ->
        (`MDRNNOutput` with leading dim B, next state (h, c))."""
        m = self.mdrnn
        where = m.location(action, flag)
        onehot = m._action_input(action, where)
        out, (h, c) = m.rnn(torch.cat([latent, onehot], -1).unsqueeze(0), (state[0].unsqueeze(0),
                                                                            state[1].unsqueeze(0)))
        out = out.squeeze(0)
        return (m._output(m._heads(out, latent, onehot, where), m.mask_logits(latent, state[0])),
                (h.squeeze(0), c.squeeze(0)))


def mdrnn_loss(out: MDRNNOutput, next_latents: torch.Tensor, rewards: torch.Tensor, dones: torch.Tensor,
               masks: torch.Tensor, valid: torch.Tensor, state_valid: torch.Tensor | None = None,
               mask_weight: float = 1.0, member_weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The world model's training loss over padded sequences.

    Args:
        out: `MDRNN.forward` output, leading dims (T, B).
        next_latents: (T, B, Z) z_{t+1}.
        rewards: (T, B) real rewards (already divided by the reward scale); the members learn them through
            `symlog` with the knee of the model that produced `out` (`out.reward_targets`, `out.reward_knee`).
        dones: (T, B) 1 where the episode ended after the step because no rewrite was left.
        masks: (T, B, R) real per-rule availability of state t.
        valid: (T, B) 1 on steps with a transition target (a rule was applied), 0 elsewhere.
        state_valid: (T, B) 1 on real states (availability targets); `valid` when None.
        mask_weight: weight of the availability loss.
        member_weights: (B, E) which episodes each reward-ensemble member learns from (bootstrap: 0 or 1); None:
            every member learns from every episode.

    Returns:
        Scalars averaged over valid steps (the availability loss over valid states): `loss` = (gmm + bce + mse) /
        (Z + 2) as in ctallec plus mask_weight * mask BCE (per rule), where mse is the mean of the reward ensemble
        members' squared errors in `symlog` space (`out.reward_knee`); and `gmm`, `reward_mse` (of the
        ensemble mean, in reward units), `done_bce`, `mask_bce`.
    """
    valid = valid.float()
    count = valid.sum().clamp_min(1.0)
    gmm = (gmm_loss(next_latents, out.mus, out.sigmas, out.logpi, reduce=False) * valid).sum() / count
    squared = (out.reward_targets - symlog(rewards, out.reward_knee).unsqueeze(-1)).pow(2)  # (T, B, E)
    if member_weights is None:
        mse = (squared.mean(-1) * valid).sum() / count
    else:  # each member's mean over its own episodes, then the mean over members
        weights = valid.unsqueeze(-1) * member_weights.unsqueeze(0)
        mse = ((squared * weights).sum((0, 1)) / weights.sum((0, 1)).clamp_min(1.0)).mean()
    mean_mse = ((out.reward.detach() - rewards).pow(2) * valid).sum() / count
    bce = (F.binary_cross_entropy_with_logits(out.done_logit, dones.float(), reduction="none") * valid).sum() / count
    state_valid = valid if state_valid is None else state_valid.float()
    mask = (F.binary_cross_entropy_with_logits(out.mask_logits, masks.float(), reduction="none").mean(-1)
            * state_valid).sum() / state_valid.sum().clamp_min(1.0)
    z = next_latents.shape[-1]
    loss = (gmm + bce + mse) / (z + 2) + mask_weight * mask
    return {"loss": loss, "gmm": gmm, "reward_mse": mean_mse, "done_bce": bce, "mask_bce": mask}


def sample_gmm(mus: torch.Tensor, sigmas: torch.Tensor, logpi: torch.Tensor, temperature: float,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """Samples z (B, Z) from mixtures mus, sigmas (B, K, Z), logpi (B, K) at `temperature` (World Models, sec. 4.4):
    component weights softmax(logpi / tau), standard deviations times sqrt(tau); tau = 0 takes the most likely
    component's mean."""
    if temperature <= 0:
        index = logpi.argmax(-1)
        return mus[torch.arange(mus.shape[0]), index]
    probs = F.softmax(logpi / temperature, -1)
    index = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    rows = torch.arange(mus.shape[0])
    eps = torch.randn(mus[rows, index].shape, generator=generator)
    return mus[rows, index] + sigmas[rows, index] * math.sqrt(temperature) * eps


__all__ = ["MDRNN", "MDRNNCell", "MDRNNOutput", "gmm_loss", "mdrnn_loss", "sample_gmm"]

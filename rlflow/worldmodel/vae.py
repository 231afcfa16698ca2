"""V: a variational auto-encoder over the graph encoder's embedding (the world model's latent state z).

RLFlow called the GNN embedding itself its "VAE"; here the embedding really goes through one.  `GraphVAE` runs the
message-passing `GraphEncoder` on an observation, normalises the graph embedding e (layer norm without parameters,
so the encoder cannot shrink it to make reconstruction trivial), encodes it to a mean and a log-variance, samples
z = mu + sigma * eps (reparameterisation, `LATENT_SIZE` = 32 by default) and decodes z back to e.

The encoder is trained together with the VAE, so grounding heads read z and keep it about the graph rather than about
nothing: which rules have a match in the graph (per-rule availability, binary cross-entropy), the observation's
global vector (cost ratio, log initial cost, step fraction, log node and candidate counts; squared error) and, per
rule, the reward its rewrite earned from this graph where one was observed (squared error): the latent must carry
what the world model has to predict, as the reward heads of PlaNet and Dreamer shape theirs.  The world model's own
availability predictor lives in `rlflow.worldmodel.mdrnn` (it reads z and h).
"""
from __future__ import annotations

from typing import Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlflow.worldmodel.encoder import GLOBAL_DIM, GraphEncoder, trim

LATENT_SIZE = 32
"""Default size of z."""


class VAEOutput(NamedTuple):
    """What `GraphVAE.forward` returns (B = batch, E = embedding size, Z = latent size, R = rules)."""

    embedding: torch.Tensor  # (B, E) normalised graph embedding (the reconstruction target)
    recon: torch.Tensor  # (B, E)
    mu: torch.Tensor  # (B, Z)
    logvar: torch.Tensor  # (B, Z)
    z: torch.Tensor  # (B, Z) sampled (or mu when not training)
    rule_logits: torch.Tensor  # (B, R) per-rule availability
    rule_rewards: torch.Tensor  # (B, R) predicted reward of each rule's rewrite (reward units / reward scale)
    globals_pred: torch.Tensor  # (B, GLOBAL_DIM)


class VAE(nn.Module):
    """Gaussian VAE over a vector: encoder to (mu, logvar), reparameterised z, decoder back.

    Args:
        input_size: size of the vector (the graph embedding).
        latent_size: size of z.
        hidden: width of the encoder's and decoder's hidden layer.
    """

    def __init__(self, input_size: int, latent_size: int = LATENT_SIZE, hidden: int = 128):
        super().__init__()
        self.input_size, self.latent_size = input_size, latent_size
        self.encoder = nn.Sequential(nn.Linear(input_size, hidden), nn.ReLU())
        self.fc_mu = nn.Linear(hidden, latent_size)
        self.fc_logvar = nn.Linear(hidden, latent_size)
        self.decoder = nn.Sequential(nn.Linear(latent_size, hidden), nn.ReLU(), nn.Linear(hidden, input_size))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, E) -> mu, logvar (B, Z); logvar is clamped to [-8, 8] to keep sampling finite."""
        h = self.encoder(x)
        return self.fc_mu(h), self.fc_logvar(h).clamp(-8.0, 8.0)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """z (B, Z) -> reconstruction (B, E)."""
        return self.decoder(z)

    def forward(self, x: torch.Tensor, sample: bool | None = None):
        """x (B, E) -> (recon (B, E), mu, logvar, z (B, Z)); samples z when training (or when `sample` is True)."""
        mu, logvar = self.encode(x)
        sample = self.training if sample is None else sample
        z = reparameterize(mu, logvar) if sample else mu
        return self.decode(z), mu, logvar, z


def reparameterize(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """z = mu + exp(logvar / 2) * eps, eps ~ N(0, I); shapes (..., Z)."""
    return mu + torch.randn_like(mu) * (0.5 * logvar).exp()


def kl_divergence(mu: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, exp(logvar)) || N(0, I)) per sample: mu, logvar (B, Z) -> (B,), always >= 0."""
    return -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum(-1)


def vae_loss(recon: torch.Tensor, target: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
             beta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The negative ELBO (up to constants) as in ctallec/world-models: summed squared error plus beta * KL.

    Args:
        recon, target: (B, E).
        mu, logvar: (B, Z).
        beta: weight of the KL term.

    Returns:
        (loss, reconstruction, kl), each a scalar mean over the batch.
    """
    reconstruction = (recon - target).pow(2).sum(-1).mean()
    kl = kl_divergence(mu, logvar).mean()
    return reconstruction + beta * kl, reconstruction, kl


class GraphVAE(nn.Module):
    """Observation -> z: the graph encoder, a normalised embedding, the VAE and the grounding heads.

    Args:
        n_rules: size of the rule registry (availability head).
        hidden: encoder width (embedding size E).
        rounds: message-passing rounds.
        latent_size: size of z.
    """

    def __init__(self, n_rules: int, hidden: int = 64, rounds: int = 3, latent_size: int = LATENT_SIZE):
        super().__init__()
        self.n_rules, self.hidden, self.n_rounds, self.latent_size = n_rules, hidden, rounds, latent_size
        self.encoder = GraphEncoder(hidden, rounds)
        self.vae = VAE(hidden, latent_size, 2 * hidden)
        self.rule_head = nn.Sequential(nn.Linear(latent_size, hidden), nn.ReLU(), nn.Linear(hidden, n_rules))
        self.globals_head = nn.Sequential(nn.Linear(latent_size, hidden), nn.ReLU(), nn.Linear(hidden, GLOBAL_DIM))
        self.reward_head = nn.Sequential(nn.Linear(latent_size, 2 * hidden), nn.ReLU(), nn.Linear(2 * hidden, n_rules))

    def embed(self, obs: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Normalised graph embedding (B, E) of a batch of observations (see `GraphEncoder.forward`)."""
        _, graph = self.encoder(trim(obs))
        return F.layer_norm(graph, graph.shape[-1:])

    def forward(self, obs: Mapping[str, torch.Tensor], sample: bool | None = None) -> VAEOutput:
        embedding = self.embed(obs)
        recon, mu, logvar, z = self.vae(embedding, sample)
        return VAEOutput(embedding, recon, mu, logvar, z, self.rule_head(z), self.reward_head(z),
                         self.globals_head(z))

    @torch.no_grad()
    def encode(self, obs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu, logvar), each (B, Z), without gradients."""
        return self.vae.encode(self.embed(obs))

    def spec(self) -> dict:
        """Constructor arguments (stored in checkpoints)."""
        return {"n_rules": self.n_rules, "hidden": self.hidden, "rounds": self.n_rounds,
                "latent_size": self.latent_size}


def graph_vae_loss(out: VAEOutput, rule_target: torch.Tensor, globals_target: torch.Tensor, beta: float = 1.0,
                   aux_weight: float = 1.0, reward_target: torch.Tensor | None = None,
                   reward_known: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The VAE loss plus the grounding heads' losses.

    Args:
        out: `GraphVAE.forward` output (batch B).
        rule_target: (B, R) 0/1 per-rule availability of each observation.
        globals_target: (B, GLOBAL_DIM) the observation's `graph` vector.
        reward_target: (B, R) reward of each rule's rewrite from this graph (scaled), where known.
        reward_known: (B, R) 1 where `reward_target` was observed.
        beta: KL weight.
        aux_weight: weight of the grounding losses.

    Returns:
        Scalars: `loss` (what to minimise), `reconstruction`, `kl`, `rules` (BCE summed over rules),
        `globals` (squared error summed over columns), `rewards` (squared error per observed (graph, rule)).
    """
    # the target is detached: the encoder learns from the grounding heads, not by making e easy to reconstruct
    loss, reconstruction, kl = vae_loss(out.recon, out.embedding.detach(), out.mu, out.logvar, beta)
    rules = F.binary_cross_entropy_with_logits(out.rule_logits, rule_target.float(), reduction="none").sum(-1).mean()
    globals_ = (out.globals_pred - globals_target.float()).pow(2).sum(-1).mean()
    rewards = torch.zeros((), device=loss.device)
    if reward_target is not None and reward_known is not None:
        known = reward_known.float()
        rewards = ((out.rule_rewards - reward_target.float()).pow(2) * known).sum() / known.sum().clamp_min(1.0)
    return {"loss": loss + aux_weight * (rules + globals_ + rewards), "reconstruction": reconstruction, "kl": kl,
            "rules": rules, "globals": globals_, "rewards": rewards}


__all__ = ["LATENT_SIZE", "VAE", "VAEOutput", "GraphVAE", "reparameterize", "kl_divergence", "vae_loss",
           "graph_vae_loss"]

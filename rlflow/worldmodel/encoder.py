"""The graph encoder: a message-passing network that embeds every node and the whole graph.

It reads the environment's padded observation (`rlflow.env.rewrite_env.RewriteEnv`), so it works on graphs of any size up to the
observation caps, and its weights do not depend on the graph: a policy trained on some models runs on others.  In the
world model its graph embedding is the input of the VAE (`rlflow.worldmodel.vae.GraphVAE`), whose latent is "V"
(RLFlow used the GNN embedding itself as the latent); the model-free policy scores candidates from its node embeddings.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from rlflow.env.features import EDGE_FEATURES, NODE_FEATURES, OP_TYPES
from rlflow.env.rewrite_env import GLOBAL_FEATURES

GLOBAL_DIM = len(GLOBAL_FEATURES)
"""Length of the observation's `graph` vector."""

_INPUT_SCALE = 0.2
"""Float features are log-scaled (0 to ~20); this brings them near unit range."""


def trim(obs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drops the padding columns no graph in the batch uses (real rows come first), to save compute.

    Node, edge and candidate arrays are cut to the largest count in the batch; indices stay valid because nodes are
    cut at the largest real node count.
    """
    out = dict(obs)
    n = max(int(obs["node_mask"].sum(-1).max().item()), 1)
    e = max(int(obs["edge_mask"].sum(-1).max().item()), 1)
    for key in ("node_op", "node_features", "node_mask"):
        out[key] = obs[key][:, :n]
    for key in ("edge_index", "edge_features", "edge_mask"):
        out[key] = obs[key][:, :e]
    return out


class MessageRound(nn.Module):
    """One round: messages along edges in both directions (producer -> consumer and back), mean-aggregated, then a
    residual update of every node."""

    def __init__(self, hidden: int):
        super().__init__()
        self.forward_message = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU())
        self.backward_message = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU())
        self.update = nn.Sequential(nn.Linear(3 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.norm = nn.LayerNorm(hidden)

    def forward(self, h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, e: torch.Tensor,
                in_degree: torch.Tensor, out_degree: torch.Tensor) -> torch.Tensor:
        """h: (M, H) flattened node states; src, dst: (K,) flat indices of real edges; e: (K, H) edge embeddings;
        in_degree, out_degree: (M, 1) clamped to >= 1.  Returns (M, H)."""
        to_dst = self.forward_message(torch.cat([h[src], e], -1))
        to_src = self.backward_message(torch.cat([h[dst], e], -1))
        incoming = torch.zeros_like(h).index_add_(0, dst, to_dst) / in_degree
        outgoing = torch.zeros_like(h).index_add_(0, src, to_src) / out_degree
        return self.norm(h + self.update(torch.cat([h, incoming, outgoing], -1)))


class GraphEncoder(nn.Module):
    """Node and graph embeddings of a batch of padded graph observations.

    Args:
        hidden: embedding width.
        rounds: message-passing rounds (information travels `rounds` edges).
    """

    def __init__(self, hidden: int = 64, rounds: int = 3):
        super().__init__()
        if rounds < 1:
            raise ValueError("rounds must be >= 1")
        self.hidden = hidden
        self.op_embed = nn.Embedding(len(OP_TYPES), hidden)
        self.node_in = nn.Linear(len(NODE_FEATURES), hidden)
        self.edge_in = nn.Sequential(nn.Linear(len(EDGE_FEATURES), hidden), nn.ReLU())
        self.rounds = nn.ModuleList(MessageRound(hidden) for _ in range(rounds))
        self.readout = nn.Sequential(nn.Linear(2 * hidden + GLOBAL_DIM, hidden), nn.ReLU(), nn.Linear(hidden, hidden))

    def forward(self, obs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeds a batch.

        Args:
            obs: observation tensors with a leading batch dimension B: `node_op` (B, N) long, `node_features`
                (B, N, F) float, `node_mask` (B, N), `edge_index` (B, E, 2) long, `edge_features` (B, E, G) float,
                `edge_mask` (B, E), `graph` (B, 5) float.  N and E may be trimmed (see `trim`).

        Returns:
            nodes (B, N, H) with zeros on padding, and graph (B, H).
        """
        node_mask = obs["node_mask"].float()
        b, n = node_mask.shape
        h = self.op_embed(obs["node_op"].long()) + self.node_in(obs["node_features"].float() * _INPUT_SCALE)
        h = h.reshape(b * n, self.hidden)
        edge_mask = obs["edge_mask"].bool()
        offsets = (torch.arange(b, device=h.device) * n).unsqueeze(-1)
        index = obs["edge_index"].long().clamp(0, n - 1) + offsets.unsqueeze(-1)
        src, dst = index[..., 0][edge_mask], index[..., 1][edge_mask]
        e = self.edge_in(obs["edge_features"].float()[edge_mask] * _INPUT_SCALE)
        ones = torch.ones(src.shape[0], 1, device=h.device)
        in_degree = torch.zeros(b * n, 1, device=h.device).index_add_(0, dst, ones).clamp_min(1.0)
        out_degree = torch.zeros(b * n, 1, device=h.device).index_add_(0, src, ones).clamp_min(1.0)
        flat_mask = node_mask.reshape(b * n, 1)
        for layer in self.rounds:
            h = layer(h, src, dst, e, in_degree, out_degree) * flat_mask
        nodes = h.reshape(b, n, self.hidden)
        count = node_mask.sum(-1, keepdim=True).clamp_min(1.0)
        mean = nodes.sum(1) / count
        peak = nodes.masked_fill(~node_mask.bool().unsqueeze(-1), -1e4).amax(1)
        peak = torch.where(node_mask.any(-1, keepdim=True), peak, torch.zeros_like(peak))
        graph = self.readout(torch.cat([mean, peak, obs["graph"].float()], -1))
        return nodes, graph


__all__ = ["GraphEncoder", "MessageRound", "trim", "GLOBAL_DIM"]

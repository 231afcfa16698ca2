"""The world model an agent plays with: the graph encoder, V (a VAE over its embedding), M (the MDN-RNN that predicts
how a rewrite changes the latent state and what it earns) and the location scorer that places a chosen rule.

What learns these networks (the replay of real episodes, the dream, the quality report) is training and lives in
`rlflow.train.worldmodel`; the agents that act with them are in `rlflow.agents`.  Submodules import torch.
"""

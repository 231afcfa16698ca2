"""The world model: the graph encoder and VAE (V), the MDN-RNN (M), the location scorer, the replay of real episodes,
the dream environment and the quality report: what learns how rewrites change a graph and its runtime.

The agents and trainers that use it (`rlflow.controller`: the controller C, the world-model agent and its training)
sit above it; nothing here imports them.  Submodules import torch; this package itself imports nothing heavy, so
`import rlflow.worldmodel` stays cheap.
"""

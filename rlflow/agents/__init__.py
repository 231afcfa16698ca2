"""The agents as `rlflow optimize` plays them: the masked-PPO candidate policy, the world-model agent (V, M and the
controller C) and the actor that plays it on a real graph, and the checkpoint files they load from.

Only inference lives here; the trainers are in `rlflow.train`, and the trained checkpoints are package data in
`rlflow/checkpoints/`.  Submodules import torch.
"""

"""The agents and their trainers: the candidate-scoring policy and masked PPO on the real environment (`policy`,
`ppo`), the world-model agent (`wm_agent`: V, M and the controller C of `latent`; `wm_actor` plays it on a real graph)
and its training (`wm_train`, `real_episodes`, `dream_ppo`), evaluation, shipping and fine-tuning.

They sit above the world model (`rlflow.worldmodel`).  Submodules import torch; this package itself imports nothing
heavy.
"""

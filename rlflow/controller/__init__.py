"""Controllers: the candidate-scoring policy and its trainers (`ppo`: model-free masked PPO on the real environment).

Submodules import torch; this package itself imports nothing heavy.
"""

"""Training the agents (`rlflow train`, `rlflow ship`): masked PPO on the real environment, the world-model agent's
loop (`rlflow.train.worldmodel`), the evaluation against a random walk, shipping a run as a checkpoint, and the
per-model fine-tuning of `rlflow optimize --finetune`.

The trainers sit above what they train (`rlflow.agents`, `rlflow.worldmodel`) and below `rlflow.optimize`, which
fine-tunes before it searches when asked to.
"""

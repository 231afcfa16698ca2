"""The world-model agent's training (RLFlow's loop): real episodes into a replay, V and M learnt from it, the
controller trained with PPO in M's dream, repeat; its settings (`config`), its report and plots (`result`,
`quality`).  `rlflow train --algo worldmodel` runs `loop.train`.
"""

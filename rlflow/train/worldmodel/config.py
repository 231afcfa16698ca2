"""The settings of a world-model agent's training run (`rlflow train --algo worldmodel`, `rlflow.train.worldmodel.loop`),
each with why it has its default: the architecture's part is `rlflow.agents.worldmodel_agent.AgentSpec`, the rest is how
the loop collects, trains and evaluates.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass, field

from rlflow.agents.worldmodel_agent import AgentSpec
from rlflow.env.rewrite_env import MAX_EDGES, MAX_NODES

DEFAULT_MODELS = ("squeezenet-1.1-tiny", "resnet-18-tiny", "resnet-50-tiny", "resnext-50-32x4d-tiny",
                  "inception-v3-tiny", "mobilenet-v2-tiny", "densenet-121-tiny", "nasrnn-tiny", "bert-base-tiny",
                  "vit-b-16-tiny", "gpt2-small-tiny")
"""The models of the model-free baseline's acceptance run (`rlflow.train.ppo.DEFAULT_MODELS`)."""


@dataclass
class Config(AgentSpec):
    """Settings of a world-model run.

    Attributes:
        models: zoo model names (built into `zoo_dir` when needed) or .onnx paths; trained and evaluated on.
        iterations: collect -> train V, M -> train the controller in the dream -> evaluate, this many times.
        random_steps: real steps of uniformly random rule-level actions in the first iteration (`make agent`: 250,
            docs/agents.md; with uncapped returns, half the default's random walks cost nothing on held-out BERT and
            still reached the PPO baseline's final return within a fifth of its steps).
        random_terminate: probability that a random action is terminate (lower explores deeper graphs).
        collect_steps: real steps with the current controller in each later iteration.
        explore_epsilon: probability of an exploratory action during controller collection.
        explore_untried: exploratory actions prefer the rules least tried from the state (else uniform).
        explore_by_match: a random or exploratory action draws among the rules (the least tried ones, with
            `explore_untried`) in proportion to their listed matches, as a uniformly random choice of a real
            candidate would (PPO's start); False: uniformly among the rules.  A rewrite that only a few rewrites
            of a common rule open is otherwise almost never seen: resnet-50-tiny starts with 17 conv-bn-fold
            matches beside two other rules, and conv-add-merge (+7.2 on cost table version 4, PPO's whole return
            there) needs the two folds of one residual block, which uniform choices among the rules almost never took.
        heldout_fraction: share of collected episodes held out of V and M training (for the quality figures).
        latent_size: size of z.
        hidden: graph-encoder width (embedding size).
        rounds: message-passing rounds.
        vae_epochs: epochs of V per iteration.
        vae_lr: V's Adam learning rate.
        vae_batch: V's batch size (states).
        beta: weight of V's KL term (small: z must keep what decides the reward).
        rnn_hidden: LSTM size of M.
        gaussians: mixture components of M.
        reward_ensemble: reward heads of M (their spread is the dream's uncertainty).
        mdrnn_epochs: epochs of M per iteration.
        mdrnn_lr: M's Adam learning rate.
        mdrnn_batch: M's batch size (episodes).
        mdrnn_validation: share of the training episodes set aside in each iteration to pick M's epoch (the lowest
            loss on them); 0: M keeps its last epoch.
        markov_reward: M's reward heads read z and the action, not the LSTM's history
            (`rlflow.worldmodel.mdrnn.MDRNN`).
        reward_bootstrap: each of M's reward heads learns from this share of the episodes, drawn once per episode
            (`reward_bootstrap`); 0: every head from every episode.  Bagging raised the held-out reward Pearson on
            the `-tiny` models but reached PPO's final return on fewer seeds than the default: its controller
            stopped after the attention fusions, and halving the dream's uncertainty penalty let it go on at the
            cost of the Pearson.  So it is off by default.
        sample_latents: M learns from, and the dream starts at, latents sampled from V's posteriors; False: their
            means.  The environment is deterministic and V's posterior noise (rms ~0.2 per dimension) is far larger
            than the latent change of one rewrite (~0.01), so sampled latents teach M a random walk that the
            controller exploits.
        learn_location: apply a chosen rule at the match the learned location scorer rates best (random matches
            when exploring); False: always at the first listed match.
        location_gamma: the scorer learns a match's reward plus this times the best return the real transitions
            show after it (`rlflow.worldmodel.location.best_returns`); 0: the reward alone (checkpoints from before
            it).  Two matches of a rule can pay the same now and very differently later (on nasrnn-tiny one MatMul
            merge opens a Gemm fusion worth 8%, another of the same reward opens nothing); with it some seeds reached
            PPO's final return in time on the `-tiny` models, without it none did.
        avoid_revisits: the greedy real evaluation never returns to a graph of its episode, as `rlflow optimize`
            plays the agent (inverse rules would let a greedy controller step back and forth between two graphs);
            where its choice would, it takes its next one.  Finding that out applies the rewrite without taking the
            step (`RewriteEnv.peek`, no reward read), which counts as no real step.
        greedy_by: how greedy real episodes (the evaluations, and the agent search's first rollout in `rlflow
            optimize`) choose a rule: "model", the one M predicts to pay most (`rlflow.agents.worldmodel_agent.Planning`);
            "controller", the controller's argmax (checkpoints from before it).  The controller still plays the
            sampled rollouts and the collection.
        match_input: what M's reward reads about a rule's match when it went to a random one (exploration),
            besides the bit that says so: "none"; "score", the location scorer's rating of the match; "embedding",
            the rating and the scorer's embedding of the matched nodes (`rlflow.worldmodel.location
            .match_descriptors`; a correction only random steps get, `rlflow.worldmodel.mdrnn.MDRNN`).  The agent's
            own steps, and so the dream's, are predicted as without it.  It raised the held-out reward Pearson,
            same seed and code, on the `-tiny` models.
        location_epochs: epochs of the location scorer per iteration.
        location_lr: the location scorer's Adam learning rate.
        mask_weight: weight of M's availability loss.
        reward_scale: rewards are predicted divided by this.
        reward_symlog: M's reward heads learn sign(r)·log(1 + |r|/knee) with the knee at this many % of the runtime
            (`rlflow.worldmodel.mdrnn.symlog`); 0: the rewards as they are.  With the knee at 1%, M ranks held-out
            rewards better (Spearman) at little cost in Pearson.
        temperature: sampling temperature of the dream.
        reward_penalty: the dream pays the ensemble mean reward minus this times the ensemble spread.
        dream_horizon: at most this many steps per dream episode (0: only max_episode_steps).
        cap_returns: a dream episode earns at most the best return real episodes of its model reached.  Off by
            default: with caps set by mostly random real episodes, any route that fills the cap is as good to the
            controller as the best first step: capped controllers rarely fused attention on
            held-out models, uncapped ones often did, and their outputs were faster.
        first_start_share: share of dreams that start from a starting graph (the others start from later states of
            the training episodes).
        dream_steps: dream steps of controller training per iteration.
        dream_envs: dreams stepped together.
        dream_rollout: steps per dream per PPO rollout.
        controller_hidden: width of the controller.
        controller_lr: controller's Adam learning rate.
        controller_gamma: the controller's discount in the dream (low: a rewrite's reward is immediate, and a long
            horizon mostly compounds the world model's errors).
        ent_coef: controller's entropy bonus.
        max_episode_steps: episode step limit (real and dream).
        max_nodes: observation node cap (the deployment section's exports fit in the default).
        max_edges: observation edge cap.
        max_candidates: candidate cap.
        scope: what a real action rewrites: "match" or "rule" (everywhere it matches; `rlflow.env.rewrite_env.SCOPES`).
        seed: seeds torch, numpy, random.
        threads: torch threads (1: polite on shared machines).
        out: folder of worldmodel.json and the plots.
        run_dir: folder of metrics and the checkpoint.
        zoo_dir: where zoo models are built (default: the zoo cache).
        cost_cache: the cost model's cache folder (default: the shared one).
        provider: the execution provider the agent is trained for.  `cuda` on a machine without CUDA trains against
            the shipped H100 cost table and its fitted estimate (`rlflow.measure.costmodel.gpu_estimate`).
        ppo_results: the model-free baseline's results (`rlflow.train.ppo`) to compare with.
        ray: play the real episodes on the Ray cluster at this address (`--ray` alone: one started here), one per
            node of this machine's kind at a time (`rlflow.train.cluster`); None: here.
        resume: continue from `<run_dir>/worldmodel.pt` when it exists.
        report: write worldmodel.json and the plots to `out` at the end.
    """

    models: tuple[str, ...] = DEFAULT_MODELS
    iterations: int = 6
    random_steps: int = 500
    random_terminate: float = 0.1
    collect_steps: int = 250
    explore_epsilon: float = 0.2
    explore_untried: bool = True
    explore_by_match: bool = False
    heldout_fraction: float = 0.2
    vae_epochs: int = 50
    vae_batch: int = 64
    beta: float = 0.01
    mdrnn_epochs: int = 150
    mdrnn_batch: int = 32
    mdrnn_validation: float = 0.0
    reward_bootstrap: float = 0.0
    sample_latents: bool = False
    location_gamma: float = 0.95
    avoid_revisits: bool = True
    greedy_by: typing.Literal["controller", "model"] = "model"
    location_epochs: int = 30
    mask_weight: float = 10.0
    temperature: float = 1.0
    reward_penalty: float = 1.0
    dream_horizon: int = 10
    cap_returns: bool = False
    first_start_share: float = 0.5
    dream_steps: int = 50_000
    dream_envs: int = 64
    dream_rollout: int = 32
    controller_gamma: float = 0.99
    ent_coef: float = 0.01
    max_episode_steps: int = 25
    max_nodes: int = MAX_NODES
    max_edges: int = MAX_EDGES
    max_candidates: int = 256
    scope: typing.Literal["match", "rule"] = "match"
    seed: int = 0
    threads: int = 1
    out: str = "docs/results"
    run_dir: str = "build/worldmodel"
    zoo_dir: str | None = None
    cost_cache: str | None = None
    provider: typing.Literal["cpu", "cuda"] = "cpu"
    ppo_results: str = "docs/results/ppo.json"
    ray: str | None = field(default=None, metadata={"const": "local"})
    resume: bool = False
    report: bool = True


__all__ = ["Config", "DEFAULT_MODELS"]

"""The world-model agent (RLFlow's loop, done properly): real rollouts -> V and M -> controller in the dream -> repeat.

Each iteration:
1. collect real episodes on the training models: uniformly random rule-level actions at first, then the current
   controller with epsilon-random exploration; a fraction of the episodes is held out (never trains V or M);
2. train V (`GraphVAE`: graph encoder + VAE + grounding heads) on the training states, encode every state;
3. train M (`MDRNN`) on the training episodes' latent sequences (z sampled from V's posteriors);
4. train the controller (`LatentPolicy` over (z, h)) with masked PPO in the dream (`DreamBatch`), which never
   touches a real graph: the action mask is M's predicted rule availability; dreams start from the real starting
   graphs and from states of the training episodes (with M's hidden state there), last at most `dream_horizon`
   steps, and pay a pessimistic reward (ensemble mean minus `reward_penalty` times the ensemble spread, clipped to
   the range of the real rewards) so that the controller cannot profit from the world model's errors;
5. evaluate: one greedy episode per model in the real environment, played as `rlflow optimize` plays the agent
   (never back to a graph of the episode, see `avoid_revisits`; these steps count as real steps too), and the world
   model's quality on the held-out episodes.

Actions are rule types plus terminate, masked by the real availability.  In the real environment the chosen rule is
applied where the learned location scorer (`rlflow.worldmodel.location`, trained on the real transitions after V)
predicts the most: the reward plus the discounted best return the real transitions show after it (`location_gamma`);
random and exploratory actions pick a random match (with `learn_location` off: the first listed match,
`rlflow.observation.first_candidate`).

Everything the run needs to resume (weights, optimiser states, replay, curves, config, rule-registry version) is in
`<run_dir>/worldmodel.pt`; metrics (`charts/`, `losses/`, `eval/`) go to `<run_dir>/metrics.csv`; the report
(`worldmodel.json`, `worldmodel-quality.png`, `sample-efficiency.png`) goes to `<out>`, compared with the model-free
PPO results in `ppo_results`.

    python -m rlflow.controller.wm_train --out docs/results
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import typing
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rlflow.env import MAX_EDGES, MAX_NODES
from rlflow.errors import InputError
from rlflow.training import CsvWriter, make_env, resolve_models, seed_everything
from rlflow.controller.wm_agent import Agent, AgentSpec, Planning, load_checkpoint, save_checkpoint
from rlflow.controller.real_episodes import real_episode, tried_pairs

log = logging.getLogger("rlflow")

DEFAULT_MODELS = ("squeezenet-1.1-tiny", "resnet-18-tiny", "resnet-50-tiny", "resnext-50-32x4d-tiny",
                  "inception-v3-tiny", "mobilenet-v2-tiny", "densenet-121-tiny", "nasrnn-tiny", "bert-base-tiny",
                  "vit-b-16-tiny", "gpt2-small-tiny")
"""The models of the model-free baseline's acceptance run (`rlflow.controller.ppo.DEFAULT_MODELS`)."""


@dataclass
class Config(AgentSpec):
    """Settings of a world-model run.

    Attributes:
        models: zoo model names (built into `zoo_dir` when needed) or .onnx paths; trained and evaluated on.
        iterations: collect -> train V, M -> train the controller in the dream -> evaluate, this many times.
        random_steps: real steps of uniformly random rule-level actions in the first iteration (`make agent`: 250;
            with uncapped returns, half the default's random walks cost nothing on held-out BERT and three seeds of
            four reached the PPO baseline's final return within a fifth of its steps, docs/results/agent-deploy/).
        random_terminate: probability that a random action is terminate (lower explores deeper graphs).
        collect_steps: real steps with the current controller in each later iteration.
        explore_epsilon: probability of an exploratory action during controller collection.
        explore_untried: exploratory actions prefer the rules least tried from the state (else uniform).
        explore_by_match: a random or exploratory action draws among the rules (the least tried ones, with
            `explore_untried`) in proportion to their listed matches, as a uniformly random choice of a real
            candidate would (PPO's start); False: uniformly among the rules.  A rewrite that only a few rewrites
            of a common rule open is otherwise almost never seen: resnet-50-tiny starts with 17 conv-bn-fold
            matches beside two other rules, and conv-add-merge (+7.2 on cost table version 4, PPO's whole return
            there) needs the two folds of one residual block.  Off: in two seeds it found that merge on
            resnext-50-32x4d-tiny once and never on resnet-50-tiny (docs/results/worldmodel-v4-session24/).
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
            (`reward_bootstrap`); 0: every head from every episode.  0.5 raised the held-out reward Pearson on three
            seeds of four (mean 0.740 against 0.589) but reached PPO's final on one seed where the default reaches
            it on two (docs/results/worldmodel-v3/worldmodel-options/b5s*, cost table version 3); on version 4,
            seeds 1 and 2: 0.693 and 0.821 against 0.696 and 0.791, PPO's final reached on seed 1 only, where the
            default reaches it on both (docs/results/worldmodel-v4/).  On seed 2 its controller stops after the
            attention fusions of bert-base-tiny and vit-b-16-tiny (+10 against +17 to +21); with half the dream's
            uncertainty penalty it goes on (+15 to +17) and the Pearson falls to 0.666.  So it is off by default.
        sample_latents: M learns from, and the dream starts at, latents sampled from V's posteriors; False: their
            means.  The environment is deterministic and V's posterior noise (rms ~0.2 per dimension) is far larger
            than the latent change of one rewrite (~0.01), so sampled latents teach M a random walk that the
            controller exploits.
        learn_location: apply a chosen rule at the match the learned location scorer rates best (random matches
            when exploring); False: always at the first listed match.
        location_gamma: the scorer learns a match's reward plus this times the best return the real transitions
            show after it (`rlflow.worldmodel.location.best_returns`); 0: the reward alone (checkpoints from before
            it).  Two matches of a rule can pay the same now and very differently later (on nasrnn-tiny one MatMul
            merge opens a Gemm fusion worth 8%, another of the same reward opens nothing); with 0.95 two seeds of
            four reached PPO's final in time and without it none did (docs/results/worldmodel-v3/worldmodel-options/).
        avoid_revisits: the greedy real evaluation never returns to a graph of its episode, as `rlflow optimize`
            plays the agent (inverse rules would let a greedy controller step back and forth between two graphs);
            where its choice would, it takes its next one.  Finding that out applies the rewrite without taking the
            step (`RewriteEnv.peek`, no reward read), which counts as no real step.
        greedy_by: how greedy real episodes (the evaluations, and the agent search's first rollout in `rlflow
            optimize`) choose a rule: "model", the one M predicts to pay most (`rlflow.controller.wm_agent.Planning`);
            "controller", the controller's argmax (checkpoints from before it).  The controller still plays the
            sampled rollouts and the collection.
        match_input: what M's reward reads about a rule's match when it went to a random one (exploration),
            besides the bit that says so: "none"; "score", the location scorer's rating of the match; "embedding",
            the rating and the scorer's embedding of the matched nodes (`rlflow.worldmodel.location
            .match_descriptors`; a correction only random steps get, `rlflow.worldmodel.mdrnn.MDRNN`).  The agent's
            own steps, and so the dream's, are predicted as without it.  Held-out reward Pearson with and without
            it, same seed and code (cost table version 4 as refilled in session 24): seed 1 0.862 against 0.502,
            seed 3 0.874 against 0.806 (docs/results/worldmodel-v4-session24/).
        location_epochs: epochs of the location scorer per iteration.
        location_lr: the location scorer's Adam learning rate.
        mask_weight: weight of M's availability loss.
        reward_scale: rewards are predicted divided by this.
        reward_symlog: M's reward heads learn sign(r)·log(1 + |r|/knee) with the knee at this many % of the runtime
            (`rlflow.worldmodel.mdrnn.symlog`); 0: the rewards as they are.  Retraining M on each of the sixth
            part's four replays, twice: held-out Spearman 0.625-0.813 as they are, 0.739-0.894 with the knee at 1%,
            Pearson 0.774-0.895 against 0.814-0.915 (docs/results/agent-deploy/README.md, seventh part).
        temperature: sampling temperature of the dream.
        reward_penalty: the dream pays the ensemble mean reward minus this times the ensemble spread.
        dream_horizon: at most this many steps per dream episode (0: only max_episode_steps).
        cap_returns: a dream episode earns at most the best return real episodes of its model reached.  Off by
            default: with caps set by mostly random real episodes, any route that fills the cap is as good to the
            controller as the best first step, and on the small-hidden training set the capped controllers fused
            attention on 1 of 12 held-out outputs, the uncapped ones on 14 of 24, and their outputs were faster
            (geomean 1.225 [1.164, 1.249] over four seeds against greedy's 1.162-1.217 in the same runs;
            docs/results/agent-deploy/no-cap/).
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
        scope: what a real action rewrites: "match" or "rule" (everywhere it matches; `rlflow.env.SCOPES`).
        seed: seeds torch, numpy, random.
        threads: torch threads (1: polite on shared machines).
        out: folder of worldmodel.json and the plots.
        run_dir: folder of metrics and the checkpoint.
        zoo_dir: where zoo models are built (default: the zoo cache).
        cost_cache: the cost model's cache folder (default: the shared one).
        provider: the execution provider the agent is trained for.  `cuda` on a machine without CUDA trains against
            the shipped H100 cost table and its fitted estimate (`rlflow.measure.estimate`).
        ppo_results: the model-free baseline's results (`rlflow.controller.ppo`) to compare with.
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
    resume: bool = False
    report: bool = True


# -------------------------------------------------------------------------------------------------- real rollouts
def collect(env, agent: Agent | None, replay, steps: int, config: Config, rng: np.random.Generator, *,
            iteration: int, progress=None) -> list:
    """Real episodes, models in turn, until `steps` real steps: random (agent None) or the controller with
    epsilon exploration (sampled actions)."""
    episodes, taken = [], 0
    tried = tried_pairs(replay.episodes) if config.explore_untried else None
    while taken < steps:
        index = len(replay.episodes) % len(env.models)
        heldout = bool(rng.random() < config.heldout_fraction)
        ep = real_episode(env, index, agent, replay, rng, greedy=False, epsilon=config.explore_epsilon,
                          random_terminate=config.random_terminate, heldout=heldout,
                          source="random" if agent is None else "controller", iteration=iteration, tried=tried,
                          random_locations=config.learn_location, explore_by_match=config.explore_by_match)
        episodes.append(ep)
        taken += len(ep.actions)
        if progress is not None:
            progress.update(len(ep.actions))
    return episodes


def evaluate_real(env, agent: Agent, replay, config: Config, rng: np.random.Generator, iteration: int,
                  reward_range: tuple | None = None) -> list:
    """One greedy episode per model in the real environment (recorded: they are real experience too), never
    returning to a graph of the episode when `config.avoid_revisits` is set, choosing as `config.greedy_by` says
    (`reward_range`: the dream's clip, for planning in M)."""
    planning = Planning.of(dataclasses.asdict(config), reward_range)
    return [real_episode(env, index, agent, replay, rng, greedy=True,
                         heldout=bool(rng.random() < config.heldout_fraction), source="eval", iteration=iteration,
                         avoid_revisits=config.avoid_revisits, planning=planning)
            for index in range(len(env.models))]


def train_vision(agent: Agent, replay, ids: list[int], episodes: list, config: Config, rng: np.random.Generator,
                 progress=None) -> dict:
    """Epochs of V over the training states (rewards observed in `episodes`); returns the last epoch's mean
    losses."""
    import torch

    from rlflow.worldmodel.vae import graph_vae_loss

    agent.vision.train()
    table = replay.reward_table(episodes, config.reward_scale)
    ids = np.asarray(ids)
    totals: dict[str, float] = {}
    for _ in range(config.vae_epochs):
        totals, batches = {}, 0
        shuffled = ids[rng.permutation(len(ids))]
        for begin in range(0, len(ids), config.vae_batch):
            chunk = shuffled[begin: begin + config.vae_batch]
            obs = replay.batch(chunk.tolist())
            out = agent.vision(obs)
            target, known = replay.reward_targets(chunk.tolist(), table)
            losses = graph_vae_loss(out, replay.masks(chunk.tolist()), obs["graph"], config.beta,
                                    reward_target=target, reward_known=known)
            agent.vision_opt.zero_grad()
            losses["loss"].backward()
            torch.nn.utils.clip_grad_norm_(agent.vision.parameters(), 5.0)
            agent.vision_opt.step()
            for key, value in losses.items():
                totals[key] = totals.get(key, 0.0) + float(value.detach())
            batches += 1
        totals = {k: v / max(batches, 1) for k, v in totals.items()}
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{totals['loss']:.2f}", kl=f"{totals['kl']:.2f}")
    return totals


def train_mdrnn(agent: Agent, replay, episodes: list, mu, logvar, config: Config, rng: np.random.Generator,
                progress=None, descriptors: dict | None = None) -> dict:
    """Epochs of M over the training episodes (z sampled from V's posteriors each epoch, or their means; random
    matches described by `descriptors`, see `rlflow.worldmodel.replay.sequences`); returns the last epoch's mean
    losses.

    With `config.mdrnn_validation`, that share of the episodes (drawn afresh each call, so every episode trains M
    in most iterations) is set aside, and M keeps the weights of the epoch with the lowest loss on them: M fits its
    training episodes almost exactly (reward Pearson 0.99 there against 0.55 on held-out ones), and later epochs
    mostly memorise.
    """
    import copy

    import torch

    from rlflow.worldmodel.mdrnn import mdrnn_loss
    from rlflow.worldmodel.replay import sequences

    masks = torch.as_tensor(np.stack(replay.rule_masks))
    terminate = agent.n_rules

    members = reward_bootstrap(replay, config.reward_ensemble, config.reward_bootstrap, config.seed)

    def losses_of(chunk: list, sample: bool) -> dict:
        seq = sequences(chunk, mu, logvar, masks, terminate, sample=sample, reward_scale=config.reward_scale,
                        descriptors=descriptors)
        out = agent.mdrnn(seq["actions"], seq["latents"], flags=seq["flags"])
        weights = torch.stack([members[id(e)] for e in chunk]) if members else None
        return mdrnn_loss(out, seq["next_latents"], seq["rewards"], seq["dones"], seq["masks"], seq["valid"],
                          seq["state_valid"], config.mask_weight, weights)

    held = int(round(config.mdrnn_validation * len(episodes))) if len(episodes) >= 10 else 0
    validation: list = []
    if held:  # (no draw otherwise: runs without a validation share keep their random stream)
        order = rng.permutation(len(episodes))
        validation, episodes = [episodes[i] for i in order[:held]], [episodes[i] for i in order[held:]]
    best_loss, best_state, best_epoch = float("inf"), None, 0
    totals: dict[str, float] = {}
    for epoch in range(1, config.mdrnn_epochs + 1):
        agent.mdrnn.train()
        order = rng.permutation(len(episodes))
        totals, batches = {}, 0
        for begin in range(0, len(order), config.mdrnn_batch):
            losses = losses_of([episodes[i] for i in order[begin: begin + config.mdrnn_batch]],
                               config.sample_latents)
            agent.mdrnn_opt.zero_grad()
            losses["loss"].backward()
            torch.nn.utils.clip_grad_norm_(agent.mdrnn.parameters(), 5.0)
            agent.mdrnn_opt.step()
            for key, value in losses.items():
                totals[key] = totals.get(key, 0.0) + float(value.detach())
            batches += 1
        totals = {k: v / max(batches, 1) for k, v in totals.items()}
        if validation:
            agent.mdrnn.eval()
            with torch.no_grad():
                totals["validation_loss"] = float(losses_of(validation, False)["loss"])
            if totals["validation_loss"] < best_loss:
                best_loss, best_state, best_epoch = (totals["validation_loss"],
                                                     copy.deepcopy(agent.mdrnn.state_dict()), epoch)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{totals['loss']:.3f}", reward=f"{totals['reward_mse']:.3f}")
    if best_state is not None:
        agent.mdrnn.load_state_dict(best_state)
        totals.update(best_epoch=float(best_epoch), best_validation_loss=best_loss)
    agent.mdrnn.eval()
    return totals


def reward_bootstrap(replay, members: int, share: float, seed: int) -> dict:
    """id(episode) -> (members,) 0/1: which reward-ensemble members learn from each episode of `replay`, each member
    from about `share` of them (at least one member per episode); empty when `share` is 0 or 1 (all learn from all).

    An episode keeps its draw for the whole run (it is seeded by the episode's place in the replay), so members
    trained over many iterations stay apart: with every member fitting every transition, the members agree where
    M has memorised its data and disagree nowhere, and their mean inherits M's wild guesses on new transitions."""
    import torch

    if share <= 0 or share >= 1:
        return {}
    out = {}
    for index, episode in enumerate(replay.episodes):
        draw = np.random.default_rng([seed, index]).random(members) < share
        if not draw.any():
            draw[np.random.default_rng([seed, index, 1]).integers(members)] = True
        out[id(episode)] = torch.as_tensor(draw, dtype=torch.float32)
    return out


def dream_reward_range(episodes: list, n_rules: int):
    """The dream's reward clip from real episodes: (low, high), each (R,): low the lowest reward any rule earned,
    high per rule the highest it earned (0 for a rule never seen earning more than nothing)."""
    import torch

    low, high = torch.zeros(n_rules), torch.zeros(n_rules)
    for e in episodes:
        for a, r in zip(e.actions, e.rewards):
            if a < n_rules:
                low[a], high[a] = min(float(low[a]), r), max(float(high[a]), r)
    return torch.full((n_rules,), float(low.min())), high


def make_dream(agent: Agent, episodes: list, mu, logvar, config: Config, seed: int,
               descriptors: dict | None = None):
    """The controller's `DreamBatch`: starts at the states of `episodes` (a `first_start_share` of the dreams at
    starting graphs), pessimistic rewards clipped per rule to the range of the real rewards the rule earned in
    `episodes` (a rule never seen earning more than nothing earns nothing in the dream either) and, with
    `cap_returns`, dream returns capped at the best return real episodes of the same model reached (less what the
    start's episode had already earned)."""
    import torch

    from rlflow.worldmodel.dream import DreamBatch, real_starts

    starts = real_starts(agent.mdrnn, episodes, mu, logvar, descriptors)
    first = starts["first"]
    share = config.first_start_share if bool((~first).any()) else 1.0
    weights = torch.where(first, share / first.sum().clamp_min(1), (1 - share) / (~first).sum().clamp_min(1))
    reward_range = dream_reward_range(episodes, agent.n_rules)
    best: dict[str, float] = {}  # per model, the best return a real (training) episode reached at any step
    for e in episodes:
        best[e.model] = max(best.get(e.model, 0.0), float(np.max(np.cumsum([0.0] + e.rewards))))
    so_far = [float(sum(episodes[i].rewards[:t])) for i, t in zip(starts["episode"].tolist(), starts["steps"].tolist())]
    caps = torch.tensor([max(0.0, best[episodes[i].model] - done) for i, done in zip(starts["episode"].tolist(), so_far)])
    start_logvar = starts["logvar"] if config.sample_latents else torch.full_like(starts["logvar"], -float("inf"))
    return DreamBatch(agent.mdrnn, starts["mu"], start_logvar, config.dream_envs, temperature=config.temperature,
                      max_episode_steps=config.max_episode_steps, reward_scale=config.reward_scale,
                      reward_penalty=config.reward_penalty, reward_range=reward_range,
                      start_state=(starts["h"], starts["c"]), start_steps=starts["steps"], start_weights=weights,
                      start_caps=caps if config.cap_returns else None,
                      horizon=config.dream_horizon or None, seed=seed)


def command_line(config: Config) -> str:
    """The command that reproduces `config` (options that differ from the defaults)."""
    defaults = Config()
    parts = ["python -m rlflow.controller.wm_train"]
    for f in dataclasses.fields(Config):
        value, default = getattr(config, f.name), getattr(defaults, f.name)
        if value == default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            parts.append(f"{flag} {','.join(value)}")
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def _load_ppo(path: str) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def main(config: Config) -> dict:
    """Runs the loop, checkpoints after every iteration, writes the report; returns what worldmodel.json holds."""
    import torch
    from tqdm.auto import tqdm

    from rlflow.controller.dream_ppo import DreamPPOConfig, train_in_dream
    from rlflow.measure.estimate import cost_model_for, estimated_only
    from rlflow.rewrites import REGISTRY_VERSION, RULES
    from rlflow.worldmodel.location import best_returns, location_quality, match_descriptors, train_location
    from rlflow.worldmodel.replay import Replay
    from rlflow.worldmodel.report import encode_all, quality

    if config.reward_symlog < 0:  # before anything is built or written
        raise InputError(f"reward_symlog must be >= 0 (0: M learns the rewards as they are), not "
                         f"{config.reward_symlog:g}")
    wall_start = time.monotonic()
    seed_everything(config.seed, config.threads)
    rng = np.random.default_rng(config.seed)
    out, run_dir = Path(config.out), Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    checkpoint_path = run_dir / "worldmodel.pt"

    n_rules = len(RULES)
    agent = Agent(config, n_rules)
    replay = Replay(n_rules)
    points: list[dict] = []
    history: list[dict] = []
    real_steps, start_iteration = 0, 0
    if config.resume and checkpoint_path.is_file():
        agent, payload = load_checkpoint(checkpoint_path)
        replay = Replay.from_state_dict(payload["replay"])
        points, history = payload["points"], payload["history"]
        real_steps, start_iteration = payload["real_steps"], payload["iteration"] + 1
        rng = np.random.default_rng()
        rng.bit_generator.state = payload["rng"]
        torch.set_rng_state(payload["torch_rng"])
        print(f"resumed from {checkpoint_path}: iteration {start_iteration}, {real_steps} real steps", flush=True)
    writer = CsvWriter(run_dir / "metrics.csv")

    paths = resolve_models(config.models, config.zoo_dir)
    cost_model = cost_model_for(config.provider, cache_dir=config.cost_cache)
    estimated_only(cost_model, measuring=False)
    env_config = dataclasses.make_dataclass("EnvConfig", [("reward", str, "cost"), ("measure_every", int, 5),
                                                          ("max_episode_steps", int, config.max_episode_steps),
                                                          ("max_nodes", int, config.max_nodes),
                                                          ("max_edges", int, config.max_edges),
                                                          ("max_candidates", int, config.max_candidates),
                                                          ("scope", str, config.scope)])()
    env = make_env(paths, env_config, cost_model)
    dream_config = DreamPPOConfig(total_steps=config.dream_steps, num_envs=config.dream_envs,
                                  num_steps=config.dream_rollout, learning_rate=config.controller_lr,
                                  gamma=config.controller_gamma,
                                  ent_coef=config.ent_coef)
    print(f"world-model agent on {len(paths)} models, {config.iterations} iterations, {n_rules} rules "
          f"(actions: rule types + terminate)", flush=True)
    quality_now: dict = history[-1] if history else {}
    for iteration in range(start_iteration, config.iterations):
        it_start = time.monotonic()
        # 1. real experience
        steps = config.random_steps if iteration == 0 else config.collect_steps
        with tqdm(total=steps, desc=f"[{iteration}] collect", leave=False, file=sys.stderr) as bar:
            collected = collect(env, None if iteration == 0 else agent, replay, steps, config, rng,
                                iteration=iteration, progress=bar)
        real_steps += sum(len(e.actions) for e in collected)
        collect_returns = [e.ret for e in collected]
        train_eps, held_eps = replay.split(False), replay.split(True)
        # 2. V
        ids = replay.state_ids(train_eps)
        with tqdm(total=config.vae_epochs, desc=f"[{iteration}] V", leave=False, file=sys.stderr) as bar:
            v_losses = train_vision(agent, replay, ids, train_eps, config, rng, bar)
        mu, logvar = encode_all(agent.vision, replay)
        # 2b. where a chosen rule goes in the real graph
        l_losses: dict = {}
        if agent.location is not None:
            with tqdm(total=config.location_epochs, desc=f"[{iteration}] location", leave=False,
                      file=sys.stderr) as bar:
                l_losses = train_location(agent.location, agent.location_opt, replay, train_eps,
                                          config.location_epochs, config.vae_batch, config.reward_scale, rng, bar,
                                          gamma=config.location_gamma)
        descriptors = (match_descriptors(agent.location, replay, replay.episodes, agent.mdrnn.match_features)
                       if agent.mdrnn.match_features else None)
        # 3. M
        with tqdm(total=config.mdrnn_epochs, desc=f"[{iteration}] M", leave=False, file=sys.stderr) as bar:
            m_losses = train_mdrnn(agent, replay, train_eps, mu, logvar, config, rng, bar, descriptors)
        quality_now = quality(agent.vision, agent.mdrnn, replay, held_eps, train_eps, mu, logvar, config.reward_scale,
                              descriptors)
        if agent.location is not None:
            # held-out targets: the best returns every real episode shows (the scorer trained on its own episodes')
            values = (best_returns(replay.episodes, n_rules, config.location_gamma) if config.location_gamma > 0
                      else None)
            quality_now.update(location_quality(agent.location, replay, held_eps, config.reward_scale,
                                                config.location_gamma, values))
        quality_now["iteration"] = iteration
        history.append(quality_now)
        # 4. controller in the dream (starts: real states of the training episodes, encoded once)
        dream = make_dream(agent, train_eps, mu, logvar, config, seed=config.seed + iteration,
                           descriptors=descriptors)
        with tqdm(total=config.dream_steps, desc=f"[{iteration}] dream PPO", leave=False, file=sys.stderr) as bar:
            d_stats = train_in_dream(agent.policy, agent.policy_opt, dream, dream_config, bar)
        # 5. real evaluation
        agent.vision.eval()
        agent.mdrnn.eval()
        evals = evaluate_real(env, agent, replay, config, rng, iteration,
                              dream_reward_range(train_eps, n_rules))
        real_steps += sum(len(e.actions) for e in evals)
        point = {"iteration": iteration, "real_steps": real_steps,
                 "eval_mean_return": float(np.mean([e.ret for e in evals])),
                 "collect_mean_return": float(np.mean(collect_returns)) if collect_returns else float("nan"),
                 "eval": {e.model: {"return": e.ret, "rules": [RULES[a].name if a < n_rules else "terminate"
                                                               for a in e.actions]} for e in evals},
                 "dream_return": d_stats["dream_return"], "seconds": time.monotonic() - it_start}
        points.append(point)
        for key, value in v_losses.items():
            writer.add_scalar(f"losses/vae_{key}", value, real_steps)
        for key, value in l_losses.items():
            writer.add_scalar(f"losses/location_{key}", value, real_steps)
        for key, value in m_losses.items():
            writer.add_scalar(f"losses/mdrnn_{key}", value, real_steps)
        for key in ("policy_loss", "value_loss", "entropy"):
            writer.add_scalar(f"losses/controller_{key}", d_stats[key], real_steps)
        writer.add_scalar("charts/dream_return", d_stats["dream_return"], real_steps)
        writer.add_scalar("charts/collect_mean_return", point["collect_mean_return"], real_steps)
        writer.add_scalar("charts/real_steps", real_steps, real_steps)
        writer.add_scalar("eval/mean_return", point["eval_mean_return"], real_steps)
        for key in ("reward_pearson", "reward_spearman", "mask_accuracy", "mask_exact", "mdn_nll", "vae_kl",
                    "vae_reconstruction", "location_pearson"):
            writer.add_scalar(f"eval/{key}", quality_now.get(key, float("nan")), real_steps)
        print(f"iteration {iteration}: real steps {real_steps}  collect {point['collect_mean_return']:+.2f}  "
              f"dream {d_stats['dream_return']:+.2f}  real greedy {point['eval_mean_return']:+.2f}  "
              f"reward r {quality_now.get('reward_pearson', float('nan')):.3f}  "
              f"mask acc {quality_now.get('mask_accuracy', float('nan')):.3f} "
              f"(exact {quality_now.get('mask_exact', float('nan')):.3f})  "
              f"location r {quality_now.get('location_pearson', float('nan')):.3f}  {point['seconds']:.0f}s",
              flush=True)
        save_checkpoint(checkpoint_path, agent, config, replay=replay.state_dict(), points=points, history=history,
                        real_steps=real_steps, iteration=iteration, rng=rng.bit_generator.state,
                        torch_rng=torch.get_rng_state())
        cost_model.save()
    writer.close()
    result = build_result(config, points, history, real_steps, REGISTRY_VERSION, n_rules,
                          time.monotonic() - wall_start)
    if config.report:
        write_report(result, history, points, out)
    return result


def build_result(config: Config, points: list[dict], history: list[dict], real_steps: int, registry_version: str,
                 n_rules: int, seconds: float) -> dict:
    """What worldmodel.json holds: the headline keys, the acceptance checks, the curves and the quality history."""
    ppo = _load_ppo(config.ppo_results)
    final_q = {k: v for k, v in (history[-1] if history else {}).items() if k != "reward_pairs"}
    final_ppo = ppo["train"]["final_mean_return"] if ppo else None
    steps_ppo = ppo["train"]["real_steps"] if ppo else None
    final_wm = points[-1]["eval_mean_return"] if points else None
    reached = next((p["real_steps"] for p in points if final_ppo is not None and p["eval_mean_return"] >= final_ppo),
                   None)
    ppo_greedy = None
    if ppo and ppo.get("eval"):
        rows = [r for r in ppo["eval"] if not r["heldout"]]
        ppo_greedy = float(np.mean([r["policy"]["return"] for r in rows]))
    return {
        "algo": "worldmodel",
        "command": command_line(config),
        "reward_pearson": final_q.get("reward_pearson"),
        "reward_spearman": final_q.get("reward_spearman"),
        "reward_spearman_moved": final_q.get("reward_spearman_moved"),
        "mask_accuracy": final_q.get("mask_accuracy"),
        "real_steps_worldmodel": real_steps,
        "real_steps_ppo": steps_ppo,
        "final_reward_worldmodel": final_wm,
        "final_reward_ppo": final_ppo,
        "real_steps_worldmodel_to_reach_ppo_final": reached,
        "ppo_greedy_eval_mean_return": ppo_greedy,
        "acceptance": {
            "reward_pearson_at_least_0.8": bool(final_q.get("reward_pearson") is not None
                                                and final_q["reward_pearson"] >= 0.8),
            "reaches_ppo_final_within_one_fifth_of_its_steps": bool(
                reached is not None and steps_ppo is not None and reached <= steps_ppo / 5
                and ppo.get("registry_version") == registry_version),
        },
        "definitions": {
            "final_reward_worldmodel": "mean return of one greedy real episode per model after the last iteration",
            "final_reward_ppo": "ppo.json train.final_mean_return: mean return of PPO's last 3 x models training "
                                "episodes (sampled actions)",
            "real_steps_worldmodel": "every real environment step of the run: random and controller collection and "
                                     "the greedy evaluations",
            "real_steps_ppo": "ppo.json train.real_steps (training steps; its random-baseline episodes excluded)",
            "reward_pearson": "predicted vs real reward on the transitions of held-out real episodes",
            "reward_spearman": "rank correlation of the same pairs (ties share their mean rank)",
            "reward_spearman_moved": "the same over the pairs whose real reward is at least "
                                     "rlflow.worldmodel.report.MOVED (% of the runtime) in size",
            "reward_pearson_agent_location": "quality: the same over the held-out transitions whose rule went where "
                                             "the location scorer chose (the dream's own kind of step)",
            "reward_pearson_random_location": "quality: the same over those whose rule went to a random match "
                                              "(exploration; which match is not in M's input)",
            "mask_accuracy": "per-rule availability predicted by M from (z, h) vs the real candidate list, per "
                             "entry over all rules, on held-out states (see mask_accuracy_seen_rules, mask_exact)",
            "location": ("actions are rule types; in the real environment a rule runs at the match the learned "
                         "location scorer rates best (random matches when exploring)" if config.learn_location else
                         "actions are rule types; a rule runs at its first listed candidate in the real environment"),
            "location_pearson": ("the location scorer's predicted vs real target on the held-out transitions: the "
                                 f"reward plus {config.location_gamma} times the best return every real episode "
                                 "shows after it" if config.location_gamma > 0 else
                                 "the location scorer's predicted vs real reward on the held-out transitions"),
        },
        "same_models_as_ppo": bool(ppo and tuple(ppo["config"]["models"]) == tuple(config.models)),
        "same_registry_as_ppo": bool(ppo and ppo.get("registry_version") == registry_version),
        "ppo_results": config.ppo_results,
        "ppo_registry_version": ppo.get("registry_version") if ppo else None,
        "ppo_config": ppo.get("config") if ppo else None,
        "ppo_curve": _ppo_curve_summary(ppo),
        "quality": final_q,
        "quality_history": [{k: v for k, v in h.items() if k != "reward_pairs"} for h in history],
        "curve": points,
        "config": asdict(config),
        "registry_version": registry_version,
        "rules": n_rules,
        "wall_seconds": seconds,
    }


def _ppo_curve_summary(ppo: dict | None, points: int = 100) -> list[list[float]] | None:
    """PPO's rolling-mean curve (as plotted) at about `points` real-step positions: [[real_steps, mean], ...]."""
    from rlflow.worldmodel.report import ppo_curve

    if not ppo or not ppo.get("curve"):
        return None
    x, y = ppo_curve(ppo["curve"], 3 * len(ppo["config"]["models"]))
    keep = np.unique(np.linspace(0, len(x) - 1, min(points, len(x))).astype(int))
    return [[float(x[i]), float(y[i])] for i in keep]


def write_report(result: dict, history: list[dict], points: list[dict], out: Path) -> None:
    """worldmodel.json, worldmodel-quality.png and sample-efficiency.png in `out`."""
    from rlflow.worldmodel.report import plot_quality, plot_sample_efficiency

    out.mkdir(parents=True, exist_ok=True)
    (out / "worldmodel.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    if history:
        plot_quality(history, history[-1], out / "worldmodel-quality.png")
    plot_sample_efficiency(points, _load_ppo(result["config"]["ppo_results"]), out / "sample-efficiency.png",
                           f"real-environment sample efficiency on {len(result['config']['models'])} -tiny models "
                           f"(cost-model reward, {result['rules']} rules)")
    print(f"wrote {out / 'worldmodel.json'}, {out / 'worldmodel-quality.png'} and {out / 'sample-efficiency.png'}: "
          f"reward Pearson {result['reward_pearson']}, mask accuracy {result['mask_accuracy']}, real steps "
          f"{result['real_steps_worldmodel']} vs PPO {result['real_steps_ppo']}, final reward "
          f"{result['final_reward_worldmodel']} vs PPO {result['final_reward_ppo']}", flush=True)


# ----------------------------------------------------------------------------------------------------- command line
def parse_args(argv: typing.Sequence[str] | None = None) -> Config:
    """A Config from `--kebab-case` options (tuples comma-separated, booleans as --flag / --no-flag)."""
    from rlflow.config_args import config_from_args

    return config_from_args(Config, argv, "python -m rlflow.controller.wm_train", __doc__.split("\n")[0])

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main(parse_args(sys.argv[1:]))

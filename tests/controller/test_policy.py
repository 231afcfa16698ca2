"""Graph encoder and candidate policy: any graph size, masking, checkpoints."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from rlflow.agents.policy import CandidatePolicy, load_checkpoint, save_checkpoint
from rlflow.env.observation import obs_to_torch
from rlflow.env.rewrite_env import RewriteEnv
from rlflow.errors import RlflowError
from rlflow.rewrites import REGISTRY_VERSION, RULES
from rlflow.worldmodel.encoder import GraphEncoder


def observations(paths, cost_model, **caps):
    """The first observation of each model, under the same caps."""
    env = RewriteEnv(list(paths), cost_model=cost_model, **caps)
    return [env.reset(options={"model": i})[0] for i in range(len(paths))]


def stack(obs_list):
    return {key: torch.as_tensor(np.stack([o[key] for o in obs_list])) for key in obs_list[0]}


def test_encoder_embeds_graphs_of_different_sizes(zoo_paths, cost_model):
    torch.manual_seed(0)
    encoder = GraphEncoder(hidden=32, rounds=3)
    obs = observations(zoo_paths.values(), cost_model, max_nodes=256, max_edges=512)
    sizes = [int(o["node_mask"].sum()) for o in obs]
    assert sizes[0] != sizes[1]
    nodes, graph = encoder(stack(obs))
    assert nodes.shape == (2, 256, 32) and graph.shape == (2, 32)
    assert not nodes[0, sizes[0]:].any() and not nodes[1, sizes[1]:].any()  # padding stays zero
    # the embedding of a graph does not depend on the padding or on the other graphs of the batch
    alone = observations([zoo_paths["resnet-18-tiny"]], cost_model, max_nodes=128, max_edges=256)
    _, graph_alone = encoder(stack(alone))
    torch.testing.assert_close(graph_alone[0], graph[0], rtol=1e-5, atol=1e-5)


def test_encoder_needs_a_round():
    with pytest.raises(ValueError):
        GraphEncoder(rounds=0)


def test_policy_gives_masked_actions_zero_probability(zoo_paths, cost_model):
    torch.manual_seed(0)
    policy = CandidatePolicy(len(RULES), hidden=32)
    obs = observations(zoo_paths.values(), cost_model, max_nodes=256, max_edges=512, max_candidates=64)
    batch = stack(obs)
    logits, values = policy(batch)
    assert logits.shape == (2, 65) and values.shape == (2,)
    mask = torch.cat([batch["cand_mask"].bool(), torch.ones(2, 1, dtype=torch.bool)], -1)
    probs = torch.softmax(logits, -1)
    assert (probs[~mask] == 0).all() and torch.allclose(probs.sum(-1), torch.ones(2))
    for _ in range(20):
        action, logprob, entropy, _ = policy.get_action_and_value(batch)
        assert mask[torch.arange(2), action].all() and torch.isfinite(logprob).all()
    greedy, *_ = policy.get_action_and_value(batch, greedy=True)
    assert mask[torch.arange(2), greedy].all()
    assert (entropy <= torch.log(mask.sum(-1).float()) + 1e-5).all()  # entropy over the valid actions only


def test_policy_runs_on_an_observation_without_candidates(zoo_paths, cost_model):
    policy = CandidatePolicy(len(RULES), hidden=16)
    obs = observations([zoo_paths["bert-base-tiny"]], cost_model, max_nodes=256, max_edges=512)[0]
    obs["cand_mask"][:] = 0
    action, *_ = policy.get_action_and_value(obs_to_torch(obs))
    assert action.item() == obs["cand_mask"].shape[0]  # terminate, the only valid action


def test_checkpoint_roundtrip_and_registry_check(tmp_path, zoo_paths, cost_model):
    torch.manual_seed(0)
    policy = CandidatePolicy(len(RULES), hidden=16, rounds=3)
    optimizer = torch.optim.Adam(policy.parameters())
    path = save_checkpoint(tmp_path / "ppo.pt", policy, optimizer, {"seed": 0}, real_steps=7)
    loaded, payload = load_checkpoint(path)
    assert payload["registry_version"] == REGISTRY_VERSION and payload["real_steps"] == 7
    assert payload["config"] == {"seed": 0} and payload["optimizer"] is not None
    batch = obs_to_torch(observations([zoo_paths["resnet-18-tiny"]], cost_model, max_nodes=256, max_edges=512)[0])
    torch.testing.assert_close(loaded(batch)[0], policy(batch)[0])
    with pytest.raises(RlflowError, match="trained on rule registry .* retrain"):
        load_checkpoint(path, registry_version="000000000000")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RlflowError, match="not an rlflow checkpoint"):
        load_checkpoint(tmp_path / "junk.pt")
    with pytest.raises(RlflowError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.pt")


RAN = []


def _side_effect():
    RAN.append("the file's code ran")
    return {}


class _Payload:
    """Unpickles by calling `_side_effect`: what a hostile checkpoint would do with os.system."""

    def __reduce__(self):
        return _side_effect, ()


def test_a_checkpoint_that_would_run_code_is_refused_unread(tmp_path):
    from rlflow.search.agent import load_agent

    path = tmp_path / "hostile.pt"
    torch.save({"format": 1, "algo": "worldmodel", "trap": _Payload()}, path)
    with pytest.raises(RlflowError, match="more than weights and arrays .it names objects or code") as refused:
        load_checkpoint(path)
    assert "\n" not in str(refused.value) and "weights_only" not in str(refused.value)
    with pytest.raises(RlflowError, match="not an rlflow checkpoint"):
        load_agent(path)
    assert RAN == []

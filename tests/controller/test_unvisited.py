"""Choosing an action that leads to no graph the episode has visited."""
from __future__ import annotations

import torch

from rlflow.agents.unvisited import choose_unvisited
from rlflow.rewrites import Match


class _Graphs:
    """An environment stand-in: action i leads to graph `children[i]` (None: a refused rewrite), the last action
    terminates."""

    def __init__(self, children, rules=None, scope="match"):
        self.children = children
        self.terminate_action = len(children)
        self.scope = scope
        self.candidates = [Match(rule, (f"n{i}",)) for i, rule in enumerate(rules or ["r"] * len(children))]

    def peek(self, action):
        return self.children[action]


def test_the_best_action_unless_it_returns_to_a_visited_graph():
    env = _Graphs(["start", "b", None, "c"])
    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    assert choose_unvisited(env, logits, {"start"}, greedy=True) == 1  # 0 goes back to the start
    assert choose_unvisited(env, logits, {"start", "b"}, greedy=True) == 3  # 2 is refused
    assert choose_unvisited(env, logits, {"start", "b", "c"}, greedy=True) == env.terminate_action
    assert torch.equal(logits, torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0]))  # the caller's logits are left alone


def test_terminate_is_a_choice_only_when_allowed_and_invalid_actions_never_are():
    env = _Graphs(["a", "b", "c"])
    logits = torch.tensor([-1e8, 0.0, -1e8, 10.0])  # terminate is the policy's favourite
    assert choose_unvisited(env, logits, set(), greedy=True) == env.terminate_action
    generator = torch.Generator().manual_seed(0)
    sampled = {choose_unvisited(env, logits, set(), greedy=False, may_terminate=False, generator=generator)
               for _ in range(50)}
    assert sampled == {1}  # the only valid rewrite; masked actions are never sampled
    assert choose_unvisited(env, logits, {"b"}, greedy=False, may_terminate=False,
                            generator=generator) == env.terminate_action  # nothing new is left


def test_with_rule_wide_actions_a_rule_that_leads_back_is_skipped_at_its_other_locations():
    """Every location of a rule-wide action leads to the same graph: one that leads back rules out the rest unpeeked;
    a refused rewrite does not (another location may apply), and with single-match actions nothing is ruled out."""
    peeked = []

    class Spy(_Graphs):
        def peek(self, action):
            peeked.append(action)
            return super().peek(action)

    logits = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0, 0.0])
    rules = ["unfuse", "unfuse", "fuse", "unfuse", "fold"]
    env = Spy(["start", "start", None, "start", "new"], rules, scope="rule")
    assert choose_unvisited(env, logits, {"start"}, greedy=True) == 4
    assert peeked == [0, 2, 4]  # 1 and 3: the rule of 0, which led back
    peeked.clear()
    env = Spy(["start", "start", None, "start", "new"], rules, scope="match")
    assert choose_unvisited(env, logits, {"start"}, greedy=True) == 4
    assert peeked == [0, 1, 2, 3, 4]

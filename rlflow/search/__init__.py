"""Search baselines over the rule library, sharing the rule and measurement interfaces with the agent."""
from rlflow.search.greedy import GreedyConfig, SearchResult, greedy

__all__ = ["GreedyConfig", "SearchResult", "greedy"]

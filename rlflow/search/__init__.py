"""Search baselines over the rule library, sharing the rule and measurement interfaces with the agent."""
from rlflow.search.candidates import Candidate, SearchResult
from rlflow.search.greedy import GreedyConfig, greedy
from rlflow.search.random_walk import RandomConfig, random_walk
from rlflow.search.taso import TasoConfig, taso

__all__ = ["Candidate", "SearchResult", "GreedyConfig", "greedy", "TasoConfig", "taso", "RandomConfig",
           "random_walk"]

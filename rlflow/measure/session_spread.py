"""How far two sessions of one model differ, learnt from placebos: the baseline measured in sessions of its own
beside the candidates of a screening.

Two onnxruntime sessions of the very same model run a percent or more apart for as long as they live (memory
placement), and a screening measures each candidate in one session against one session of the baseline, so a
bootstrap over its rounds sees none of that: on a decode step a model was called faster or slower than itself in 14
of 50 such measurements (docs/results/decoders/first-step-limit-no-undo/), and greedy stepped on noise.  A screening
given a `SessionSpread` builds the baseline in several sessions instead.  Their spread, pooled over every batch of a
search, estimates the variance of one session's time; a candidate's speedup is its time against the mean of the
baseline's sessions, with an interval of a Student t quantile (on the degrees of freedom the placebos gave) times
that spread.  Where sessions hardly differ the interval is narrow, where they differ it is as wide as they do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence

import numpy as np

from rlflow.measure.bootstrap import Ratio

FIRST_SESSIONS = 6
"""Sessions of the baseline in a search's first batch: five degrees of freedom before the first candidate is called.
With one the t quantile is 12.7 and nothing could be; with three (4 sessions) an unlucky spread refused greedy's
every-fusion candidate (a 9-15% gain in its screening) on BERT-L4 in 3 of 6 runs, and the whole gain was lost."""

LATER_SESSIONS = 2
"""Sessions of the baseline in every later batch: one more degree of freedom each."""


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile: exact for 1 and 2 degrees of freedom, a Cornish-Fisher expansion in the normal quantile
    beyond (within 0.003 of the tables from 3 on)."""
    if df == 1:
        return math.tan(math.pi * (p - 0.5))
    if df == 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3)
            + (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / (92160 * df ** 4))


@dataclass
class SessionSpread:
    """The pooled spread of the baseline's sessions over a search's screenings (one per shape profile: sessions of a
    decode step differ more at one cache length than at another).

    Attributes:
        squares: the sum over batches of the squared deviations of the baseline's sessions from their batch's mean
            (in log time).
        df: its degrees of freedom: the baseline's sessions less one, summed over batches.
    """

    squares: float = 0.0
    df: int = 0

    def sessions(self) -> int:
        """Sessions of the baseline the next batch builds."""
        return FIRST_SESSIONS if self.df == 0 else LATER_SESSIONS

    @property
    def sigma(self) -> float:
        """The estimated standard deviation of one session's log time."""
        return math.sqrt(self.squares / self.df) if self.df else math.nan

    def ratios(self, times: Sequence[Sequence[float]], baselines: int, confidence: float = 0.95) -> list[Ratio]:
        """Learns a batch's spread and returns each candidate's speedup over the baseline.

        `times[i][r]`: session i's time in round r, the first `baselines` sessions the baseline's.  A session's value
        is its median log time relative to the baseline's mean in the same round (a round's drift cancels); a
        candidate's log speedup is the baseline's mean value less its own, whose variance is a session's plus the
        mean's (`sigma`² (1 + 1 / baselines)).
        """
        if baselines < 2:
            raise ValueError("a session spread needs the baseline in two sessions at least")
        logs = np.log(np.asarray(times, dtype=float))
        values = np.median(logs - logs[:baselines].mean(axis=0), axis=1)
        base = values[:baselines]
        self.squares += float(((base - base.mean()) ** 2).sum())
        self.df += baselines - 1
        half = t_quantile(1 - (1 - confidence) / 2, self.df) * self.sigma * math.sqrt(1 + 1 / baselines)
        return [Ratio(math.exp(gain), math.exp(gain - half), math.exp(gain + half), confidence)
                for gain in base.mean() - values[baselines:]]

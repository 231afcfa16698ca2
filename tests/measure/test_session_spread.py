"""A screening's baseline in several sessions: the t quantile, the interval's calibration on simulated sessions that
differ, and `compare` building the baseline's sessions."""
from __future__ import annotations

import numpy as np
import pytest

from rlflow.measure import compare
from rlflow.measure.session_spread import FIRST_SESSIONS, LATER_SESSIONS, SessionSpread, t_quantile
from tests.measure.test_timing import mlp  # noqa: F401 - the fixture

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 8: 2.306, 10: 2.228, 30: 2.042}


def test_t_quantile_matches_the_tables():
    for df, table in T975.items():
        assert t_quantile(0.975, df) == pytest.approx(table, abs=0.005)


def _batch(rng, gains, baselines, session_sigma, round_sigma=0.005, rounds=9):
    """Times of `baselines` baseline sessions then one session per candidate (true speedups `gains`), each session
    off by its own lasting factor, every round by a drift all share."""
    speed = np.array([1.0] * baselines + list(gains))
    offsets = np.exp(session_sigma * rng.standard_normal(len(speed)))
    drift = np.exp(0.02 * rng.standard_normal(rounds))
    noise = np.exp(round_sigma * rng.standard_normal((len(speed), rounds)))
    return (offsets / speed)[:, None] * drift[None, :] * noise


def _screen(rng, gains, session_sigma, batches=3):
    """A search's first `batches` screenings on one spread: the ratios of the last."""
    spread = SessionSpread()
    for _ in range(batches):
        baselines = spread.sessions()
        ratios = spread.ratios(_batch(rng, gains, baselines, session_sigma), baselines)
    return ratios


def test_a_model_against_itself_is_called_faster_or_slower_about_as_often_as_the_confidence_says():
    rng = np.random.default_rng(0)
    for sigma in (0.002, 0.02):
        calls = [r for _ in range(400) for r in _screen(rng, [1.0] * 3, sigma)]
        wrong = sum(r.faster or r.slower for r in calls) / len(calls)
        assert 0.02 < wrong < 0.08, (sigma, wrong)


def test_sessions_that_differ_widen_the_interval_so_a_small_gain_is_not_claimed_on_them():
    rng = np.random.default_rng(1)
    quiet = [_screen(rng, [1.05], 0.002)[0] for _ in range(50)]
    loud = [_screen(rng, [1.05], 0.03)[0] for _ in range(50)]
    assert sum(r.faster for r in quiet) >= 48
    assert sum(r.faster for r in loud) <= 25
    width = {name: np.median([np.log(r.high / r.low) for r in ratios]) for name, ratios in (("quiet", quiet),
                                                                                              ("loud", loud))}
    assert width["loud"] > 5 * width["quiet"], width


def test_the_spread_pools_its_batches_and_needs_two_baseline_sessions():
    spread = SessionSpread()
    assert spread.sessions() == FIRST_SESSIONS
    spread.ratios(np.ones((FIRST_SESSIONS + 1, 9)), FIRST_SESSIONS)
    assert spread.df == FIRST_SESSIONS - 1 and spread.sessions() == LATER_SESSIONS
    spread.ratios(np.ones((LATER_SESSIONS + 1, 9)), LATER_SESSIONS)
    assert spread.df == FIRST_SESSIONS + LATER_SESSIONS - 2 and spread.sigma == 0.0
    with pytest.raises(ValueError):
        spread.ratios(np.ones((2, 9)), 1)


def test_compare_builds_the_baseline_in_the_spreads_sessions_in_one_block(mlp):  # noqa: F811
    spread = SessionSpread()
    first = compare([mlp, mlp, mlp], rounds=12, spread=spread)
    second = compare([mlp, mlp, mlp], rounds=12, spread=spread)
    assert first.extra["baseline_sessions"] == FIRST_SESSIONS and second.extra["baseline_sessions"] == LATER_SESSIONS
    assert first.extra["blocks"] == 1 and second.extra["session_df"] == spread.df == FIRST_SESSIONS
    assert len(second.timings) == len(second.ratios) == 3 and second.ratios[0].median == 1.0
    assert all(r.low < r.median < r.high for r in second.ratios[1:])

"""The engine's load report: the fitted prefill rate and the board the Load stream waits on."""

from __future__ import annotations

import random
import threading

import pytest

from inference.load import LoadBoard, LoadReport, PrefillRate


def test_the_prefill_rate_fits_a_fixed_time_plus_a_time_per_token():
    rate = PrefillRate(forward_s=0.5, token_s=1.0)  # a prior far off
    rng = random.Random(1)
    for _ in range(400):
        tokens = rng.randint(1, 2048)
        rate.observe(tokens, 0.012 + 3e-5 * tokens + rng.gauss(0, 1e-4))
    assert rate.known
    assert rate.forward_s == pytest.approx(0.012, abs=1e-3)
    assert rate.token_s == pytest.approx(3e-5, rel=0.05)


def test_forwards_of_one_size_keep_the_slope_and_fit_the_fixed_time():
    rate = PrefillRate(forward_s=0.0, token_s=1e-4)
    for _ in range(50):
        rate.observe(1, 0.02)  # decodes only
    assert rate.token_s == 1e-4 and rate.forward_s == pytest.approx(0.02 - 1e-4)
    assert not rate.known  # reported as unknown: one size alone cannot tell fixed from per-token time


def test_the_board_wakes_waiters_on_a_change_only():
    board = LoadBoard()
    seen, first = board.wait(-1, timeout_s=0.0)
    assert first == LoadReport()
    board.publish(LoadReport())  # no change: no new version
    assert board.wait(seen, timeout_s=0.01) == (seen, first)
    got = []
    waiter = threading.Thread(target=lambda: got.append(board.wait(seen, timeout_s=5.0)))
    waiter.start()
    board.publish(LoadReport(queued_tokens=300, running=2))
    waiter.join(5)
    assert got and got[0][0] == seen + 1 and got[0][1].queued_tokens == 300

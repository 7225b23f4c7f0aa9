"""The entropy law fit and its holds() test."""

from __future__ import annotations

import numpy as np
import pytest

from glance_sgl.law import expected_accept, fit_entropy_law


def test_fit_recovers_the_law_and_holds():
    rng = np.random.default_rng(0)
    h = rng.uniform(0.0, 4.0, 400)
    mean = expected_accept(h, 2.0, 1.5, 15)
    a = np.clip(np.round(mean + rng.normal(0, 0.5, h.shape)), 0, 15)
    fit = fit_entropy_law(h, a, max_accept=15)
    assert fit.b1 == pytest.approx(1.5, rel=0.25) and fit.b0 == pytest.approx(2.0, rel=0.25)
    assert fit.spearman < 0 and fit.spearman_p < 0.05 and fit.binned_r2 >= 0.5
    assert fit.holds()
    assert fit.to_dict()["holds"] is True


def test_no_relation_does_not_hold():
    rng = np.random.default_rng(1)
    h = rng.uniform(0.0, 4.0, 300)
    a = rng.integers(0, 4, 300)
    assert not fit_entropy_law(h, a, max_accept=15).holds()
    # the wrong sign (more acceptance at high entropy) does not hold either
    assert not fit_entropy_law(h, np.round(h * 2), max_accept=15).holds()


def test_needs_enough_rounds():
    with pytest.raises(ValueError, match="at least 30"):
        fit_entropy_law([1.0] * 10, [1] * 10, max_accept=15)
    with pytest.raises(ValueError, match="differ"):
        fit_entropy_law([1.0] * 40, [1] * 39, max_accept=15)

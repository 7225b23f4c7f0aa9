"""The entropy ("draftability") law (design §1).

Per round: H = entropy (nats) of the target's next-token distribution at the root, a = accepted drafts
(bonus excluded). Model: ``logit p = b0 - b1*H`` and ``E[a | H] = min(p / (1 - p), B - 1)``, fitted by least
squares over rounds. The law holds when b1 > 0, Spearman(H, a) < 0 with p < 0.05, and the fit explains at
least half of what any function of H could (binned R^2 >= 0.5).

Callers fit it on rounds whose accepted length the drafter decided: a request's last round is cut short by the
end of the answer (EOS, a stop string, max_tokens) whatever its entropy, so ``glance bench`` leaves it out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

MIN_ROUNDS = 30
B1_CAP = 25.0


@dataclass
class LawFit:
    b0: float
    b1: float
    spearman: float
    spearman_p: float
    binned_r2: float
    n_rounds: int
    max_accept: int

    def predict(self, entropy: np.ndarray | float) -> np.ndarray:
        """Expected accepted drafts E[a | H] for entropies ``entropy`` (nats)."""
        return expected_accept(np.asarray(entropy, dtype=np.float64), self.b0, self.b1, self.max_accept)

    def holds(self) -> bool:
        return bool(self.b1 > 0 and self.spearman < 0 and self.spearman_p < 0.05 and self.binned_r2 >= 0.5)

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "b0": self.b0,
            "b1": self.b1,
            "spearman": self.spearman,
            "spearman_p": self.spearman_p,
            "binned_r2": self.binned_r2,
            "n_rounds": self.n_rounds,
            "holds": self.holds(),
        }


def expected_accept(h: np.ndarray, b0: float, b1: float, max_accept: int) -> np.ndarray:
    """``min(exp(b0 - b1*h), max_accept)``: p/(1-p) with logit p = b0 - b1*h."""
    return np.minimum(np.exp(np.clip(b0 - b1 * h, -50.0, 50.0)), float(max_accept))


def binned_r2(h: np.ndarray, a: np.ndarray, pred: np.ndarray, n_bins: int = 10) -> float:
    """How much of the between-bin variance of ``a`` (over quantile bins of ``h``) the prediction explains.

    ``1 - sum_b n_b (mean_a_b - mean_pred_b)^2 / sum_b n_b (mean_a_b - mean_a)^2``; 0 when the bins do not
    differ at all.
    """
    n_bins = max(2, min(n_bins, len(h) // 3))
    edges = np.quantile(h, np.linspace(0, 1, n_bins + 1))
    bins = np.clip(np.searchsorted(edges, h, side="right") - 1, 0, n_bins - 1)
    total, resid = 0.0, 0.0
    mean_a = a.mean()
    for b in range(n_bins):
        sel = bins == b
        if not sel.any():
            continue
        n = sel.sum()
        total += n * (a[sel].mean() - mean_a) ** 2
        resid += n * (a[sel].mean() - pred[sel].mean()) ** 2
    return float(1.0 - resid / total) if total > 0 else 0.0


def fit_entropy_law(entropies: Sequence[float], accepted: Sequence[int], max_accept: int) -> LawFit:
    """Fit the law over rounds (at least 30). ``max_accept`` is ``block_size - 1``."""
    from scipy.optimize import least_squares
    from scipy.stats import spearmanr

    h = np.asarray(entropies, dtype=np.float64)
    a = np.asarray(accepted, dtype=np.float64)
    if h.shape != a.shape:
        raise ValueError(f"entropies ({h.shape}) and accepted ({a.shape}) differ in length")
    if len(h) < MIN_ROUNDS:
        raise ValueError(f"the entropy law needs at least {MIN_ROUNDS} rounds, got {len(h)}")
    mean_a = float(a.mean())
    p0 = min(max(mean_a / (1.0 + mean_a), 1e-4), 1 - 1e-4)
    start = np.array([math.log(p0 / (1 - p0)), 1.0])

    def residuals(theta: np.ndarray) -> np.ndarray:
        return expected_accept(h, theta[0], theta[1], max_accept) - a

    fit = least_squares(residuals, start, bounds=([-np.inf, -np.inf], [np.inf, B1_CAP]))
    b0, b1 = (float(x) for x in fit.x)
    if np.all(h == h[0]) or np.all(a == a[0]):
        rho, pval = 0.0, 1.0
    else:
        res = spearmanr(h, a)
        rho, pval = float(res.statistic), float(res.pvalue)
    r2 = binned_r2(h, a, expected_accept(h, b0, b1, max_accept))
    return LawFit(b0=b0, b1=b1, spearman=rho, spearman_p=pval, binned_r2=r2, n_rounds=len(h), max_accept=max_accept)

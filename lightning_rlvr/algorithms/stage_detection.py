"""Rising vs plateau stage of an entropy curve (arXiv 2508.02260's two stages), detected online. [derived]

The paper splits RLVR training "based on entropy dynamics" into a *rising* stage (entropy falls fast while
accuracy rises fast) and a *plateau* stage (both change slowly); its released code has no detector (it
switches its position method on in a fixed step window, ALGORITHMS.md §13.1). This is our detector.

Model. At every step the whole history ``y_0 … y_{n-1}`` is fitted by a continuous two-segment line with
its break at ``τ``,

.. math::
    y_x \\approx a + b_1 \\min(x - τ, 0) + b_2 \\max(x - τ, 0),

by least squares for every admissible ``τ`` at once (prefix sums make each fit O(1)), keeping the ``τ``
with the smallest squared error. ``b_1`` is the rising-stage slope, ``b_2`` the plateau slope. A least-
squares break point is robust to per-step noise (no smoothing lag to correct for) and locates the
intersection of the two asymptotes of a smooth bend, which is where a reader of the curve puts it.

Decision. The fit says "plateau" when (i) both segments hold at least ``min_segment`` steps, (ii) entropy
fell in the first one by at least ``min_drop`` of its starting level (``-b_1 τ ≥ min_drop · (a - b_1 τ)``),
so a flat or rising curve is never a transition, and (iii) the second is flat relative to the first,
``b_2 ≥ κ b_1`` (``|b_2| ≤ κ |b_1|`` for a still-falling plateau; a rising plateau also counts). The stage
switches only after the fit said "plateau" for ``patience`` consecutive steps (a confirmation window), and
the plateau is absorbing, as the paper's stages are sequential: noise after the transition cannot flip
it back. The reported transition step is the break ``τ`` of the confirming fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["HingeFit", "OnlineStageDetector", "fit_hinge", "linear_slope", "linear_slope_with_error"]


@dataclass(frozen=True)
class HingeFit:
    """The best continuous two-segment fit of a series: break ``tau``, level ``a`` at the break, slopes."""

    tau: int
    level: float
    slope_before: float
    slope_after: float
    sse: float

    @property
    def start_level(self) -> float:
        """Fitted value at ``x = 0``."""
        return self.level - self.slope_before * self.tau


def fit_hinge(values: np.ndarray | list[float], min_segment: int) -> HingeFit | None:
    """Least-squares continuous two-segment line over ``x = 0..n-1``, break ``τ ∈ [min_segment, n - min_segment]``.

    Returns ``None`` when the series is too short for two segments of ``min_segment`` points.
    """
    y = np.asarray(values, dtype=np.float64)
    n = y.size
    if min_segment < 2 or n < 2 * min_segment:
        return None
    x = np.arange(n, dtype=np.float64)
    # Prefix sums over x < τ (index τ = number of points on the left).
    zero = np.zeros(1)
    cx, cx2 = np.concatenate([zero, np.cumsum(x)]), np.concatenate([zero, np.cumsum(x * x)])
    cy, cxy = np.concatenate([zero, np.cumsum(y)]), np.concatenate([zero, np.cumsum(x * y)])
    tau = np.arange(min_segment, n - min_segment + 1, dtype=np.float64)
    t = tau.astype(np.int64)
    n_left, n_right = tau, n - tau
    sx_l, sx_r = cx[t], cx[-1] - cx[t]
    sx2_l, sx2_r = cx2[t], cx2[-1] - cx2[t]
    sy_l, sy_r = cy[t], cy[-1] - cy[t]
    sxy_l, sxy_r = cxy[t], cxy[-1] - cxy[t]
    # Features f1 = min(x-τ, 0), f2 = max(x-τ, 0); their sums and cross-products with 1 and y.
    s1, s2 = sx_l - tau * n_left, sx_r - tau * n_right
    s11 = sx2_l - 2 * tau * sx_l + tau**2 * n_left
    s22 = sx2_r - 2 * tau * sx_r + tau**2 * n_right
    gram = np.zeros((tau.size, 3, 3))
    gram[:, 0, 0] = n
    gram[:, 0, 1] = gram[:, 1, 0] = s1
    gram[:, 0, 2] = gram[:, 2, 0] = s2
    gram[:, 1, 1] = s11
    gram[:, 2, 2] = s22
    rhs = np.stack([np.full_like(tau, cy[-1]), sxy_l - tau * sy_l, sxy_r - tau * sy_r], axis=-1)
    theta = np.linalg.solve(gram, rhs[..., None])[..., 0]
    sse = float(np.dot(y, y)) - np.einsum("ij,ij->i", theta, rhs)
    best = int(np.argmin(sse))
    a, b1, b2 = theta[best]
    return HingeFit(tau=int(t[best]), level=float(a), slope_before=float(b1), slope_after=float(b2),
                    sse=float(max(sse[best], 0.0)))


def linear_slope(values: np.ndarray | list[float]) -> float:
    """Least-squares slope of ``values`` against ``0..n-1`` (``nan`` for fewer than 2 points)."""
    y = np.asarray(values, dtype=np.float64)
    if y.size < 2:
        return math.nan
    x = np.arange(y.size, dtype=np.float64) - (y.size - 1) / 2
    return float(np.dot(x, y - y.mean()) / np.dot(x, x))


def linear_slope_with_error(values: np.ndarray | list[float]) -> tuple[float, float]:
    """Least-squares slope of ``values`` against ``0..n-1`` and its standard error.

    ``se = sqrt(SSR / (n - 2) / Σ (x - x̄)²)``, the ordinary-least-squares error of the slope; ``nan`` for
    fewer than 3 points.
    """
    y = np.asarray(values, dtype=np.float64)
    if y.size < 3:
        return math.nan, math.nan
    x = np.arange(y.size, dtype=np.float64) - (y.size - 1) / 2
    sxx = float(np.dot(x, x))
    slope = float(np.dot(x, y - y.mean()) / sxx)
    residual = y - y.mean() - slope * x
    return slope, math.sqrt(float(np.dot(residual, residual)) / (y.size - 2) / sxx)


class OnlineStageDetector:
    """Online rising → plateau decision on a scalar series (the per-step token-mean entropy).

    Args:
        min_segment: fewest steps in each stage of a fit (also the earliest decision: ``2·min_segment``).
        flatness: κ, the plateau's slope as a fraction of the rising stage's (``b_2 ≥ κ b_1``).
        min_drop: the rising stage must lower entropy by this fraction of its starting level.
        patience: consecutive steps the fit must say "plateau" before the stage switches.
        reward_flatness: if set, the reward series (second argument of :meth:`update`), fitted with the
            same break, must also flatten: reward slope after ``≤ reward_flatness ×`` slope before (> 0).
        reward_confidence: z: both reward conditions must hold by ``z`` standard errors of the slopes
            (``before − z·se > 0`` and ``after + z·se ≤ reward_flatness · before``), so a short, noisy
            post-break segment cannot pass on chance (0 compares point estimates).
    """

    def __init__(self, min_segment: int = 50, flatness: float = 0.25, min_drop: float = 0.2, patience: int = 20,
                 reward_flatness: float | None = None, reward_confidence: float = 2.0) -> None:
        if min_segment < 2:
            raise ValueError(f"min_segment must be >= 2, got {min_segment}")
        if not 0 <= flatness < 1:
            raise ValueError(f"flatness must be in [0, 1), got {flatness}")
        if not 0 <= min_drop < 1:
            raise ValueError(f"min_drop must be in [0, 1), got {min_drop}")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        if reward_flatness is not None and not 0 <= reward_flatness < 1:
            raise ValueError(f"reward_flatness must be in [0, 1) or None, got {reward_flatness}")
        self.min_segment, self.flatness, self.min_drop = min_segment, flatness, min_drop
        if reward_confidence < 0:
            raise ValueError(f"reward_confidence must be >= 0, got {reward_confidence}")
        self.patience, self.reward_flatness, self.reward_confidence = patience, reward_flatness, reward_confidence
        self.values: list[float] = []
        self.rewards: list[float] = []
        self.steps: list[int] = []
        self.streak = 0
        self.transition: int | None = None
        self.confirmed_at: int | None = None
        self.last_fit: HingeFit | None = None

    @property
    def plateau(self) -> bool:
        return self.transition is not None

    def says_plateau(self, fit: HingeFit) -> bool:
        """The decision rule (ii)–(iii) of the module docstring for one fit (and the reward condition)."""
        b1, b2 = fit.slope_before, fit.slope_after
        start = fit.start_level
        if not (b1 < 0 and start > 0 and -b1 * fit.tau >= self.min_drop * start and b2 >= self.flatness * b1):
            return False
        if self.reward_flatness is None:
            return True
        rewards = np.asarray(self.rewards, dtype=np.float64)
        before, se_before = linear_slope_with_error(rewards[: fit.tau])
        after, se_after = linear_slope_with_error(rewards[fit.tau :])
        if self.reward_confidence == 0:  # point estimates (also where a 2-point segment has no error)
            se_before = se_after = 0.0
        z = self.reward_confidence
        return before - z * se_before > 0 and after + z * se_after <= self.reward_flatness * before

    def update(self, value: float, reward: float | None = None, step: int | None = None) -> bool:
        """Add one step's value (and reward); returns whether the stage is plateau after it.

        ``step`` labels the point (default: its index); :attr:`transition` and :attr:`confirmed_at` are
        such labels. Non-finite values are skipped (not added to the history).
        """
        if self.plateau:
            return True
        if not math.isfinite(value) or (self.reward_flatness is not None and (reward is None or not math.isfinite(reward))):
            return False
        self.values.append(float(value))
        self.rewards.append(float(reward) if reward is not None else math.nan)
        self.steps.append(len(self.steps) if step is None else int(step))
        fit = fit_hinge(self.values, self.min_segment)
        self.last_fit = fit
        self.streak = self.streak + 1 if fit is not None and self.says_plateau(fit) else 0
        if self.streak >= self.patience:
            self.transition, self.confirmed_at = self.steps[fit.tau], self.steps[-1]
        return self.plateau

    def state_dict(self) -> dict:
        return {"values": list(self.values), "rewards": list(self.rewards), "steps": list(self.steps),
                "streak": self.streak,
                "transition": self.transition, "confirmed_at": self.confirmed_at}

    def load_state_dict(self, state: dict) -> None:
        self.values = [float(v) for v in state["values"]]
        self.rewards = [float(v) for v in state["rewards"]]
        self.steps = [int(v) for v in state["steps"]]
        self.streak = int(state["streak"])
        self.transition = state["transition"]
        self.confirmed_at = state["confirmed_at"]
        self.last_fit = fit_hinge(self.values, self.min_segment) if self.values else None

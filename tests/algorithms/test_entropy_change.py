"""First-order entropy change against finite differences of a softmax; STEER's Ω and weights by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_rlvr.algorithms.entropy_change import (
    balancing_coefficient,
    first_order_entropy_change,
    predicted_entropy_flow,
    sampled_logit_flow,
    sampled_token_score,
    steer_omega,
    steer_weights,
)

VOCAB = 50
ETA = 1e-4


def entropy_of(logits: torch.Tensor) -> torch.Tensor:
    return torch.distributions.Categorical(logits=logits.double()).entropy()


def stats(logits: torch.Tensor, token: int):
    """log π(a), H and S̄ = Σ π_j² (log π_j + H) in float64."""
    log_p = torch.log_softmax(logits.double(), -1)
    p = log_p.exp()
    entropy = -(p * log_p).sum()
    return log_p[token], entropy, (p * p * (log_p + entropy)).sum()


def policy_gradient_step(logits: torch.Tensor, token: int, advantage: float, ratio: float,
                         eta: float = ETA) -> torch.Tensor:
    """Logits after one ascent step of size ``eta`` on A·r·log π(a): Δz = η A r (e_a − π), by autograd."""
    z = logits.double().clone().requires_grad_(True)
    objective = advantage * ratio * torch.log_softmax(z, -1)[token]
    (grad,) = torch.autograd.grad(objective, z)
    return (logits.double() + eta * grad).detach()


@pytest.mark.parametrize("seed", range(5))
def test_first_order_change_of_any_logit_step_matches_finite_differences(seed):
    g = torch.Generator().manual_seed(seed)
    logits, direction = torch.randn(VOCAB, generator=g, dtype=torch.float64) * 2, torch.randn(VOCAB, generator=g)
    # central difference: its error is O(η³), so the first-order term is checked tightly
    observed = (entropy_of(logits + ETA * direction) - entropy_of(logits - ETA * direction)) / 2
    predicted = ETA * first_order_entropy_change(logits, direction.double())
    assert predicted.item() == pytest.approx(observed.item(), rel=1e-5)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("which", ["likely", "median", "rare"])
@pytest.mark.parametrize("advantage", [1.3, -0.7])
def test_predicted_flow_of_one_token_update_matches_finite_differences(seed, which, advantage):
    """E3, ΔH ≈ η·c with c = −A r (S(a) − S̄), to 0.1% at η = 1e-4 (the error is O(η²))."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(VOCAB, generator=g, dtype=torch.float64) * 2.5
    order = torch.argsort(logits)
    token = int({"likely": order[-1], "median": order[VOCAB // 2], "rare": order[0]}[which])
    ratio = 1.1
    observed = entropy_of(policy_gradient_step(logits, token, advantage, ratio)) - entropy_of(logits)
    logp, entropy, sbar = stats(logits, token)
    flow = predicted_entropy_flow(torch.tensor(advantage), logp, entropy, sbar, ratio=torch.tensor(ratio))
    assert (ETA * flow).item() == pytest.approx(observed.item(), rel=1e-3)


def only_za_and_exact(logits: torch.Tensor, token: int) -> tuple[float, float, float]:
    """(observed, "only z_a moves" estimate −η π(1−π)(log π + H), E3) for an A = 1 update of ``token``."""
    # central difference (error O(η³)): some of these tokens' first-order changes nearly cancel
    observed = (entropy_of(policy_gradient_step(logits, token, 1.0, 1.0))
                - entropy_of(policy_gradient_step(logits, token, 1.0, 1.0, eta=-ETA))) / 2
    logp, entropy, sbar = stats(logits, token)
    pi = logp.exp()
    only_za = -ETA * pi * (1 - pi) * (logp + entropy)
    exact = ETA * predicted_entropy_flow(torch.tensor(1.0), logp, entropy, sbar)
    return observed.item(), only_za.item(), exact.item()


def test_only_the_sampled_logit_shortcut_is_wrong_for_rare_tokens():
    """A rare token with A > 0 raises entropy by ≈ η S̄ (the −S̄ term); the shortcut gives ~π_a of that."""
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2.5
    _, _, sbar = stats(logits, 0)
    observed, only_za, exact = only_za_and_exact(logits, int(torch.argmin(logits)))
    assert observed > 0 and exact == pytest.approx(observed, rel=1e-4)
    assert ETA * sbar.item() == pytest.approx(observed, rel=0.05)
    assert abs(only_za) < 0.01 * observed
    # tokens likelier than e^{-H} but with S(a) < S̄: the shortcut even gets the sign wrong
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, _, sbar = stats(logits, 0)
    log_p = torch.log_softmax(logits, -1)
    scores = sampled_token_score(log_p, stats(logits, 0)[1])
    between = [j for j in range(VOCAB) if 0 < scores[j] < sbar]
    assert between
    for token in between:
        observed, only_za, exact = only_za_and_exact(logits, token)
        assert observed > 0 and exact == pytest.approx(observed, rel=1e-4) and only_za < 0


def test_sampled_logit_flow_is_the_first_order_change_when_only_the_sampled_logit_moves():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 2
    token, advantage, ratio = int(torch.argsort(logits)[-3]), -0.9, 1.2
    logp, entropy, _ = stats(logits, token)
    step = torch.zeros(VOCAB, dtype=torch.float64)
    step[token] = advantage * ratio * (1 - logp.exp())  # the a-th component of A r (e_a − π)
    observed = (entropy_of(logits + ETA * step) - entropy_of(logits - ETA * step)) / 2
    predicted = ETA * sampled_logit_flow(torch.tensor(advantage), logp, entropy, ratio=torch.tensor(ratio))
    assert predicted.item() == pytest.approx(observed.item(), rel=1e-5)


def test_balancing_coefficient_gives_zero_net_flow():
    flow = torch.tensor([0.3, -0.5, 0.1, -0.25, 0.0])
    up, down = flow[flow > 0].sum().item(), -flow[flow < 0].sum().item()
    lam = balancing_coefficient(up, down)
    assert lam == pytest.approx((0.75 - 0.4) / (0.75 + 0.4))
    assert (1 + lam) * up - (1 - lam) * down == pytest.approx(0.0, abs=1e-12)
    assert balancing_coefficient(0.0, 0.0) == 0.0 and balancing_coefficient(1.0, 0.0) == -1.0


def test_sbar_is_a_nonnegative_covariance_and_the_centred_score_has_zero_mean():
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p = torch.softmax(logits, -1)
    log_p = torch.log(p)
    _, entropy, sbar = stats(logits, 0)
    covariance = (p * p * log_p).sum() - (p * p).sum() * (p * log_p).sum()  # Cov_{j~π}(π_j, log π_j)
    assert sbar.item() == pytest.approx(covariance.item(), rel=1e-9) and sbar > 0
    scores = sampled_token_score(log_p, entropy)
    assert (p * (scores - sbar)).sum().item() == pytest.approx(0.0, abs=1e-12)


def test_flow_is_zero_where_the_clip_is_active():
    flow = predicted_entropy_flow(torch.tensor([1.0, 1.0]), torch.tensor([-0.5, -0.5]), torch.tensor([1.0, 1.0]),
                                  torch.tensor([0.1, 0.1]), clipped=torch.tensor([False, True]))
    assert flow[0] != 0 and flow[1] == 0


# ----------------------------------------------------------------------------- STEER Ω
def omega_code_by_hand(a: float, logp: float, old_logp: float, old_h: float) -> float:
    x = min(max(math.exp(logp), 1e-8), 1 - 1e-8)
    old_p = min(max(math.exp(old_logp), 1e-8), 1.0)
    return a / old_p * x * (1 - x) * (math.log(x) + old_h)


def test_omega_modes_match_hand_computed_values():
    a, logp, old_logp = torch.tensor([1.5, -0.5, 2.0]), torch.tensor([-0.2, -3.0, 0.0]), torch.tensor([-0.3, -2.5, 0.0])
    old_h, h, sbar = torch.tensor([0.9, 1.7, 0.0]), torch.tensor([1.0, 1.6, 0.0]), torch.tensor([0.05, 0.02, 0.0])
    code = steer_omega("code", a, logp, old_logp, old_h)
    expected = [omega_code_by_hand(*v) for v in zip(a.tolist(), logp.tolist(), old_logp.tolist(), old_h.tolist())]
    torch.testing.assert_close(code, torch.tensor(expected), rtol=1e-5, atol=1e-7)
    assert code[2].item() == 0.0  # π = 1: Ω is 0, not NaN (in float32 1 − 1e-8 rounds to 1, as in the code)
    onlyza = steer_omega("onlyza", a, logp, old_logp, old_h)
    torch.testing.assert_close(onlyza, code * logp.exp().clamp(1e-8, 1 - 1e-8))
    exact = steer_omega("exact", a, logp, old_logp, entropy=h, sbar=sbar)
    by_hand = [ai * math.exp(lp - olp) * (math.exp(lp) * (lp + hi) - si) for ai, lp, olp, hi, si in
               zip(a.tolist(), logp.tolist(), old_logp.tolist(), h.tolist(), sbar.tolist())]
    torch.testing.assert_close(exact, torch.tensor(by_hand), rtol=1e-5, atol=1e-7)


def test_omega_non_finite_values_become_zero_and_missing_inputs_are_named():
    omega = steer_omega("code", torch.tensor([1.0, 1.0]), torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0]),
                        torch.tensor([float("nan"), 1.5]))
    assert omega[0] == 0 and omega[1] != 0
    with pytest.raises(ValueError, match="sbar"):
        steer_omega("exact", torch.ones(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="old-policy entropy"):
        steer_omega("code", torch.ones(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="unknown omega"):
        steer_omega("bogus", torch.ones(1), torch.zeros(1), torch.zeros(1), torch.zeros(1))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- STEER weights
def test_exp_weights_by_hand():
    m = torch.tensor([0.0, 0.05, 0.1])
    k = -math.log(0.8) / 0.1
    torch.testing.assert_close(steer_weights(m, 0.0, 0.1, "exp", w_min=0.8),
                               torch.tensor([1.0, math.exp(-k * 0.05), 0.8]))
    # largest |Ω| below the floor 0.02: k uses the floor, so no token reaches w_min
    small = steer_weights(torch.tensor([0.0, 0.01]), 0.0, 0.01, "exp", w_min=0.8)
    torch.testing.assert_close(small, torch.tensor([1.0, math.sqrt(0.8)]))
    # all |Ω| equal (above the floor): every token gets w_min
    torch.testing.assert_close(steer_weights(torch.full((3,), 0.3), 0.3, 0.3, "exp", w_min=0.8), torch.full((3,), 0.8))


def test_linear_weights_by_hand():
    m = torch.tensor([0.0, 0.05, 0.1])
    torch.testing.assert_close(steer_weights(m, 0.0, 0.1, "linear", 0.8, 1.2), torch.tensor([1.2, 1.0, 0.8]))
    torch.testing.assert_close(steer_weights(torch.tensor([0.1, 0.4]), 0.1, 0.4, "linear", 0.5, 1.5),
                               torch.tensor([1.5, 0.5]))
    # all |Ω| equal: the middle of the range
    torch.testing.assert_close(steer_weights(torch.full((2,), 0.2), 0.2, 0.2, "linear", 0.8, 1.2), torch.full((2,), 1.0))
    with pytest.raises(ValueError, match="unknown weight mode"):
        steer_weights(m, 0.0, 0.1, "cubic")  # type: ignore[arg-type]

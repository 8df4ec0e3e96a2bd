"""Chunked log-probabilities / entropy against torch.distributions, explicit loops and autograd."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Categorical

from lightning_rlvr.ops.logprobs import naive_logprobs_and_entropy, token_logprobs_and_entropy

HUGE_CHUNK = 10**9


def _inputs(seed: int, shape=(3, 5), vocab: int = 13, scale: float = 2.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g) * scale).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=g)
    return logits, labels


def ref_loop(logits: list[float], label: int, temperature: float) -> tuple[float, float]:
    """log π(label) and entropy of softmax(logits / T) for one row, with the math module."""
    u = [z / temperature for z in logits]
    m = max(u)
    lse = m + math.log(sum(math.exp(x - m) for x in u))
    logp = [x - lse for x in u]
    entropy = -sum(math.exp(lp) * lp for lp in logp)
    return logp[label], entropy


def ref_autograd(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    """Explicit float64 log_softmax (differentiable), independent of the module's closed forms."""
    logp_all = torch.log_softmax(logits.double() / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# ----------------------------------------------------------------------------- values
@pytest.mark.parametrize("temperature", [0.3, 0.7, 1.0, 1.8])
@pytest.mark.parametrize("chunk_size", [1, 4, HUGE_CHUNK])
def test_logprobs_and_entropy_match_categorical_for_3d_inputs_and_temperatures(temperature, chunk_size):
    logits, labels = _inputs(0, shape=(2, 6))
    out = token_logprobs_and_entropy(logits, labels, temperature=temperature, chunk_size=chunk_size)
    dist = Categorical(logits=logits.double() / temperature)
    assert out.logprobs.shape == labels.shape and out.entropy.shape == labels.shape
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    torch.testing.assert_close(out.logprobs.double(), dist.log_prob(labels), rtol=1e-5, atol=1e-5)
    # atol 3e-5: H = lse - sum(p u) in float32 cancels when |u| = |z| / T is large (~20 at T = 0.3).
    torch.testing.assert_close(out.entropy.double(), dist.entropy(), rtol=1e-5, atol=3e-5)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.3])
def test_logprobs_and_entropy_match_explicit_python_loop(temperature):
    logits, labels = _inputs(1, shape=(2, 3), vocab=7)
    out = token_logprobs_and_entropy(logits, labels, temperature=temperature, chunk_size=2)
    for b in range(2):
        for t in range(3):
            lp, h = ref_loop(logits[b, t].tolist(), int(labels[b, t]), temperature)
            assert out.logprobs[b, t].item() == pytest.approx(lp, rel=1e-5, abs=1e-5)
            assert out.entropy[b, t].item() == pytest.approx(h, rel=1e-5, abs=1e-5)


def test_uniform_logits_give_log_vocab_entropy_and_minus_log_vocab_logprob():
    v = 17
    logits = torch.full((2, 3, v), 4.2)
    labels = torch.zeros(2, 3, dtype=torch.long)
    out = token_logprobs_and_entropy(logits, labels, temperature=0.9)
    torch.testing.assert_close(out.entropy, torch.full((2, 3), math.log(v)))
    torch.testing.assert_close(out.logprobs, torch.full((2, 3), -math.log(v)))


def test_large_logits_are_numerically_stable():
    logits, labels = _inputs(2, scale=300.0)
    out = token_logprobs_and_entropy(logits, labels, temperature=0.5, chunk_size=3)
    dist = Categorical(logits=logits.double() / 0.5)
    assert torch.isfinite(out.logprobs).all() and torch.isfinite(out.entropy).all()
    torch.testing.assert_close(out.logprobs.double(), dist.log_prob(labels), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.entropy.double(), dist.entropy(), rtol=1e-5, atol=1e-4)


def test_1d_and_2d_inputs_are_supported():
    logits, labels = _inputs(3, shape=(7,))
    out = token_logprobs_and_entropy(logits, labels)
    assert out.logprobs.shape == (7,)
    torch.testing.assert_close(out.logprobs, Categorical(logits=logits).log_prob(labels))
    one = token_logprobs_and_entropy(logits[0], labels[0])
    assert one.logprobs.shape == ()
    torch.testing.assert_close(one.logprobs, out.logprobs[0])


def test_int32_labels_are_accepted():
    logits, labels = _inputs(4)
    torch.testing.assert_close(
        token_logprobs_and_entropy(logits, labels.int()).logprobs, token_logprobs_and_entropy(logits, labels).logprobs
    )


def test_without_entropy_returns_none_and_same_logprobs():
    logits, labels = _inputs(5)
    out = token_logprobs_and_entropy(logits, labels, with_entropy=False)
    assert out.entropy is None
    torch.testing.assert_close(out.logprobs, Categorical(logits=logits).log_prob(labels))


def test_naive_reference_matches_categorical():
    logits, labels = _inputs(6)
    out = naive_logprobs_and_entropy(logits, labels, temperature=0.8)
    dist = Categorical(logits=logits / 0.8)
    torch.testing.assert_close(out.logprobs, dist.log_prob(labels))
    torch.testing.assert_close(out.entropy, dist.entropy())


# ----------------------------------------------------------------------------- chunking
@pytest.mark.parametrize("chunk_size", [1, 3, 7])
def test_chunked_values_and_gradients_equal_unchunked(chunk_size):
    logits, labels = _inputs(7, shape=(3, 5))  # 15 rows: not a multiple of 7 or 2
    g = torch.Generator().manual_seed(70)
    g_lp = torch.randn(labels.shape, generator=g)
    g_h = torch.randn(labels.shape, generator=g)

    def run(cs):
        z = logits.clone().requires_grad_(True)
        out = token_logprobs_and_entropy(z, labels, temperature=0.7, chunk_size=cs, entropy_grad=True)
        (grad,) = torch.autograd.grad((out.logprobs * g_lp).sum() + (out.entropy * g_h).sum(), z)
        return out.logprobs.detach(), out.entropy.detach(), grad

    lp_c, h_c, g_c = run(chunk_size)
    lp_f, h_f, g_f = run(HUGE_CHUNK)
    torch.testing.assert_close(lp_c, lp_f, rtol=0, atol=1e-6)
    torch.testing.assert_close(h_c, h_f, rtol=0, atol=1e-6)
    torch.testing.assert_close(g_c, g_f, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- bf16
@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_bf16_logits_are_computed_in_float32(temperature):
    logits32, labels = _inputs(8, shape=(2, 4))
    logits = logits32.bfloat16()
    out = token_logprobs_and_entropy(logits, labels, temperature=temperature, chunk_size=3)
    assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    # Exact up to float32 rounding against the bf16 values upcast ...
    dist = Categorical(logits=logits.float() / temperature)
    torch.testing.assert_close(out.logprobs, dist.log_prob(labels), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.entropy, dist.entropy(), rtol=1e-5, atol=1e-5)
    # ... and within bf16 rounding of the original float32 logits.
    dist32 = Categorical(logits=logits32 / temperature)
    torch.testing.assert_close(out.logprobs, dist32.log_prob(labels), rtol=0, atol=3e-2)
    torch.testing.assert_close(out.entropy, dist32.entropy(), rtol=0, atol=3e-2)


def test_bf16_logits_gradient_has_bf16_dtype_and_matches_float32_reference():
    logits32, labels = _inputs(9, shape=(2, 4))
    z = logits32.bfloat16().requires_grad_(True)
    g_up = torch.randn(labels.shape, generator=torch.Generator().manual_seed(90))
    out = token_logprobs_and_entropy(z, labels, temperature=0.9, chunk_size=3, entropy_grad=True)
    (grad,) = torch.autograd.grad((out.logprobs * g_up).sum() + (out.entropy * g_up).sum(), z)
    assert grad.dtype == torch.bfloat16
    zr = z.detach().double().requires_grad_(True)
    lp, h = ref_autograd(zr, labels, 0.9)
    (ref,) = torch.autograd.grad((lp * g_up.double()).sum() + (h * g_up.double()).sum(), zr)
    torch.testing.assert_close(grad.double(), ref, rtol=2e-2, atol=1e-2)


# ----------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("chunk_size", [2, HUGE_CHUNK])
def test_gradient_of_logprobs_and_entropy_matches_autograd_through_log_softmax(temperature, chunk_size):
    logits, labels = _inputs(10, shape=(3, 4))
    g = torch.Generator().manual_seed(100)
    g_lp = torch.randn(labels.shape, generator=g)
    g_h = torch.randn(labels.shape, generator=g)

    z = logits.clone().requires_grad_(True)
    out = token_logprobs_and_entropy(z, labels, temperature=temperature, chunk_size=chunk_size, entropy_grad=True)
    assert out.logprobs.requires_grad and out.entropy.requires_grad
    (grad,) = torch.autograd.grad((out.logprobs * g_lp).sum() + (out.entropy * g_h).sum(), z)

    zr = logits.double().requires_grad_(True)
    lp, h = ref_autograd(zr, labels, temperature)
    (ref,) = torch.autograd.grad((lp * g_lp.double()).sum() + (h * g_h.double()).sum(), zr)
    assert grad.dtype == torch.float32
    torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [0.6, 1.0])
def test_gradient_matches_naive_reference_function(temperature):
    logits, labels = _inputs(11, shape=(2, 5))
    g = torch.Generator().manual_seed(110)
    g_lp, g_h = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
    z1 = logits.clone().requires_grad_(True)
    out = token_logprobs_and_entropy(z1, labels, temperature=temperature, chunk_size=3, entropy_grad=True)
    (g1,) = torch.autograd.grad((out.logprobs * g_lp).sum() + (out.entropy * g_h).sum(), z1)
    z2 = logits.clone().requires_grad_(True)
    nv = naive_logprobs_and_entropy(z2, labels, temperature=temperature)
    (g2,) = torch.autograd.grad((nv.logprobs * g_lp).sum() + (nv.entropy * g_h).sum(), z2)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-5)


def test_entropy_is_detached_by_default():
    logits, labels = _inputs(12)
    out = token_logprobs_and_entropy(logits.clone().requires_grad_(True), labels, temperature=0.8, chunk_size=4)
    assert out.logprobs.requires_grad
    assert not out.entropy.requires_grad


# (seed, kernel arguments, the differentiated output, upstream gradient seed or None for a plain sum)
GRADIENT_CASES = {
    "logprobs, entropy detached": (12, {"temperature": 0.8, "chunk_size": 4}, "logprobs", 120),
    "logprobs, entropy disabled": (13, {"with_entropy": False, "entropy_grad": True}, "logprobs", None),
    "entropy only": (14, {"temperature": 1.2, "entropy_grad": True}, "entropy", None),
}


@pytest.mark.parametrize("seed, kwargs, output, upstream_seed", GRADIENT_CASES.values(), ids=GRADIENT_CASES.keys())
def test_gradient_of_one_output_matches_the_float64_autograd_reference(seed, kwargs, output, upstream_seed):
    logits, labels = _inputs(seed)
    upstream = (torch.ones(labels.shape) if upstream_seed is None
                else torch.randn(labels.shape, generator=torch.Generator().manual_seed(upstream_seed)))
    z = logits.clone().requires_grad_(True)
    out = token_logprobs_and_entropy(z, labels, **kwargs)
    (grad,) = torch.autograd.grad((getattr(out, output) * upstream).sum(), z)
    zr = logits.double().requires_grad_(True)
    lp, h = ref_autograd(zr, labels, kwargs.get("temperature", 1.0))
    (ref,) = torch.autograd.grad(((lp if output == "logprobs" else h) * upstream.double()).sum(), zr)
    torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-5)


def test_gradient_through_noncontiguous_shifted_logits_slice():
    logits, labels = _inputs(15, shape=(2, 6))
    z = logits.clone().requires_grad_(True)
    shifted = z[:, :-1]  # the usual next-token shift: a non-contiguous view
    out = token_logprobs_and_entropy(shifted, labels[:, 1:], chunk_size=3)
    (grad,) = torch.autograd.grad(out.logprobs.sum(), z)
    assert (grad[:, -1] == 0).all()
    zr = logits.double().requires_grad_(True)
    lp, _ = ref_autograd(zr[:, :-1], labels[:, 1:], 1.0)
    (ref,) = torch.autograd.grad(lp.sum(), zr)
    torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-5)


def test_entropy_gradient_matches_central_finite_differences_on_float64_input():
    # The function computes in float32 internally, so the finite-difference tolerance is ~1e-3.
    logits, labels = _inputs(16, shape=(2, 2), vocab=6, dtype=torch.float64)
    temperature = 0.8
    z = logits.clone().requires_grad_(True)
    out = token_logprobs_and_entropy(z, labels, temperature=temperature, chunk_size=3, entropy_grad=True)
    w = torch.randn(labels.shape, generator=torch.Generator().manual_seed(160), dtype=torch.float64)
    (grad,) = torch.autograd.grad((out.entropy.double() * w).sum() + (out.logprobs.double() * w).sum(), z)
    assert grad.dtype == torch.float64

    def f(x):
        o = token_logprobs_and_entropy(x, labels, temperature=temperature, chunk_size=3)
        return ((o.entropy.double() * w).sum() + (o.logprobs.double() * w).sum()).item()

    h = 1e-2
    flat = logits.reshape(-1)
    for k in range(flat.numel()):
        plus = flat.clone()
        minus = flat.clone()
        plus[k] += h
        minus[k] -= h
        fd = (f(plus.reshape(logits.shape)) - f(minus.reshape(logits.shape))) / (2 * h)
        assert grad.reshape(-1)[k].item() == pytest.approx(fd, abs=1e-3), k


def test_minus_inf_logits_give_finite_entropy_and_logprob_gradient():
    """Masked vocabulary entries (logit −inf) have p = 0 and must not poison the row.

    Categorical and autograd through log_softmax both handle this. Regression: the chunked kernel once computed
    ``p·u = 0·(−inf) = nan`` for the entropy, and its backward multiplied the (zero) entropy upstream gradient by
    ``log p + H = −inf`` / nan, so even the log-prob gradient became nan.
    """
    logits = torch.tensor([[0.0, 1.0, -0.5, float("-inf")]])
    labels = torch.tensor([1])
    z = logits.clone().requires_grad_(True)
    out = token_logprobs_and_entropy(z, labels, with_entropy=True)
    (grad,) = torch.autograd.grad(out.logprobs.sum(), z)
    zr = logits.clone().requires_grad_(True)
    (ref,) = torch.autograd.grad(torch.log_softmax(zr, -1)[0, 1], zr)
    assert torch.isfinite(out.logprobs).all()
    assert torch.isfinite(grad).all(), f"log-prob gradient is {grad.tolist()} with a -inf logit (expected {ref.tolist()})"
    torch.testing.assert_close(grad, ref)
    expected_h = Categorical(logits=logits).entropy()
    assert torch.isfinite(out.entropy).all(), f"entropy is {out.entropy.tolist()}, expected {expected_h.tolist()}"
    torch.testing.assert_close(out.entropy, expected_h)


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("temperature", [0.0, -1.0])
def test_nonpositive_temperature_raises_value_error(temperature):
    logits, labels = _inputs(0)
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(logits, labels, temperature=temperature)


@pytest.mark.parametrize("chunk_size", [0, -3])
def test_chunk_size_below_one_raises_value_error(chunk_size):
    logits, labels = _inputs(0)
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(logits, labels, chunk_size=chunk_size)


@pytest.mark.parametrize("label_shape", [(3, 4), (5, 3), (3, 5, 1), (15,)])
def test_logits_labels_shape_mismatch_raises_value_error(label_shape):
    logits, _ = _inputs(0, shape=(3, 5))
    with pytest.raises(ValueError):
        token_logprobs_and_entropy(logits, torch.zeros(label_shape, dtype=torch.long))


# ----------------------------------------------------------------------------- S̄ (first-order entropy change)
def ref_sbar_loop(logits: list[float], temperature: float) -> float:
    """Σ_j p_j² (log p_j + H) for one row, with the math module."""
    u = [z / temperature for z in logits]
    m = max(u)
    lse = m + math.log(sum(math.exp(x - m) for x in u))
    logp = [x - lse for x in u]
    entropy = -sum(math.exp(lp) * lp for lp in logp)
    return sum(math.exp(2 * lp) * (lp + entropy) for lp in logp)


@pytest.mark.parametrize("chunk_size", [1, 3, HUGE_CHUNK])
def test_sbar_matches_a_python_loop_and_leaves_logprobs_entropy_and_gradients_unchanged(chunk_size):
    logits, labels = _inputs(5, shape=(2, 4), vocab=11)
    logits.requires_grad_(True)
    with_sbar = token_logprobs_and_entropy(logits, labels, 0.8, chunk_size, entropy_grad=True, with_sbar=True)
    plain = token_logprobs_and_entropy(logits, labels, 0.8, chunk_size, entropy_grad=True)
    assert plain.sbar is None and not with_sbar.sbar.requires_grad
    for b in range(2):
        for t in range(4):
            expected = ref_sbar_loop(logits[b, t].tolist(), 0.8)
            assert with_sbar.sbar[b, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(with_sbar.logprobs, plain.logprobs)
    torch.testing.assert_close(with_sbar.entropy, plain.entropy)
    grads = [torch.autograd.grad((s.logprobs.sum() + s.entropy.sum()), logits)[0] for s in (with_sbar, plain)]
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(naive_logprobs_and_entropy(logits, labels, 0.8).sbar, with_sbar.sbar,
                               rtol=1e-5, atol=1e-6)


def test_sbar_is_finite_with_masked_logits():
    logits, labels = _inputs(6, shape=(3,), vocab=6)
    logits[:, 4:] = -torch.inf
    out = token_logprobs_and_entropy(logits, labels.clamp_max(3), with_sbar=True)
    expected = [ref_sbar_loop(row[:4].tolist(), 1.0) for row in logits]
    torch.testing.assert_close(out.sbar, torch.tensor(expected), rtol=1e-5, atol=1e-6)

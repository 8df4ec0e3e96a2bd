"""Loss aggregation modes against loop references, and micro-batch splitting with global normalisers."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr.algorithms.aggregation import AGGREGATION_MODES, aggregate_loss, aggregation_normalizer


# ----------------------------------------------------------------------------- loop references
def ref_aggregate(loss: list[list[float]], mask: list[list[float]], mode: str, scale: float | None = None) -> float:
    b = len(loss)
    t = len(loss[0])
    token_sums = []
    token_counts = []
    for i in range(b):
        s = 0.0
        n = 0.0
        for j in range(t):
            s += loss[i][j] * mask[i][j]
            n += mask[i][j]
        token_sums.append(s)
        token_counts.append(n)
    valid_seqs = [i for i in range(b) if token_counts[i] > 0]
    if mode == "token-mean":
        total = sum(token_counts)
        return sum(token_sums) / total if total > 0 else 0.0
    if mode == "seq-mean-token-sum":
        return sum(token_sums[i] for i in valid_seqs) / len(valid_seqs) if valid_seqs else 0.0
    if mode == "seq-mean-token-mean":
        per_seq = [token_sums[i] / token_counts[i] for i in valid_seqs]
        return sum(per_seq) / len(valid_seqs) if valid_seqs else 0.0
    if mode == "seq-mean-token-sum-norm":
        c = float(t) if scale is None else float(scale)
        return sum(token_sums) / (b * c)
    raise AssertionError(mode)


def ref_normalizer(mask: list[list[float]], mode: str, scale: float | None = None) -> float:
    if mode == "token-mean":
        return sum(sum(row) for row in mask)
    if mode == "seq-mean-token-sum-norm":
        return len(mask) * (float(len(mask[0])) if scale is None else float(scale))
    return float(sum(1 for row in mask if sum(row) > 0))


def _batch(seed: int, b: int = 6, t: int = 8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(b, t, generator=g, dtype=dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
    mask[1] = 0.0  # one sequence without any valid token
    mask[2, 0] = 0.0  # a hole (e.g. a masked prompt/tool token), not only right padding
    return loss, mask


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aggregate_loss_matches_loop_reference_for_every_mode(mode, seed):
    loss, mask = _batch(seed)
    out = aggregate_loss(loss, mask, mode)
    assert out.dim() == 0
    assert out.item() == pytest.approx(ref_aggregate(loss.tolist(), mask.tolist(), mode), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregation_normalizer_matches_loop_reference(mode):
    _, mask = _batch(3)
    assert aggregation_normalizer(mask, mode).item() == pytest.approx(ref_normalizer(mask.tolist(), mode))
    assert aggregation_normalizer(mask, mode, loss_scale_factor=100.0).item() == pytest.approx(
        ref_normalizer(mask.tolist(), mode, 100.0)
    )


def test_token_mean_is_sum_over_valid_tokens_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4) / 2)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(7 / (2 * 3))


def test_seq_mean_token_mean_ignores_sequences_without_valid_tokens():
    loss = torch.tensor([[2.0, 4.0], [100.0, 100.0], [1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    # per-seq means 3 and 1 over the 2 sequences that have tokens (not over 3)
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(2.0, rel=1e-6)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6.0 + 1.0) / 2, rel=1e-6)


def test_seq_mean_token_sum_norm_divides_by_all_sequences_times_constant():
    loss, mask = _batch(4)
    b, t = loss.shape
    s = (loss * mask).sum().item()
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(s / (b * t), rel=1e-5)
    out = aggregate_loss(loss, mask, "seq-mean-token-sum-norm", loss_scale_factor=4096)
    assert out.item() == pytest.approx(s / (b * 4096), rel=1e-5)
    assert out.item() == pytest.approx(
        ref_aggregate(loss.tolist(), mask.tolist(), "seq-mean-token-sum-norm", 4096), rel=1e-5
    )


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_fractional_mask_weights_match_loop_reference(mode):
    loss, mask = _batch(5)
    w = torch.rand(mask.shape, generator=torch.Generator().manual_seed(1)) * 0.9 + 0.1
    mask = mask * w
    out = aggregate_loss(loss, mask, mode)
    assert out.item() == pytest.approx(ref_aggregate(loss.tolist(), mask.tolist(), mode), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_bool_mask_is_accepted_and_equals_float_mask(mode):
    loss, mask = _batch(6)
    torch.testing.assert_close(aggregate_loss(loss, mask.bool(), mode), aggregate_loss(loss, mask, mode))


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_all_masked_batch_aggregates_to_zero_not_nan(mode):
    loss = torch.randn(3, 4)
    out = aggregate_loss(loss, torch.zeros(3, 4), mode)
    assert out.item() == 0.0


# Uneven micro-batches (1, 3 and 4 sequences) whose valid-token counts differ.
MICRO_SPLITS = [(0, 1), (1, 4), (4, 8)]


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
@pytest.mark.parametrize("scale", [None, 64.0])
def test_microbatches_with_minibatch_normalizer_sum_to_full_batch_loss_and_gradient(mode, scale):
    loss, mask = _batch(7, b=8, t=10, dtype=torch.float64)
    full_param = loss.clone().requires_grad_(True)
    full = aggregate_loss(full_param, mask, mode, loss_scale_factor=scale)
    (full_grad,) = torch.autograd.grad(full, full_param)

    norm = aggregation_normalizer(mask, mode, loss_scale_factor=scale)
    micro_param = loss.clone().requires_grad_(True)
    total = torch.zeros((), dtype=torch.float64)
    for start, stop in MICRO_SPLITS:
        total = total + aggregate_loss(
            micro_param[start:stop], mask[start:stop], mode, normalizer=norm, loss_scale_factor=scale
        )
    (micro_grad,) = torch.autograd.grad(total, micro_param)

    assert total.item() == pytest.approx(full.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(micro_grad, full_grad, rtol=1e-12, atol=1e-12)
    expected = ref_aggregate(loss.tolist(), mask.tolist(), mode, scale)
    # rel 1e-7: seq-mean-token-mean divides each sequence by (|o_i| + 1e-8)
    assert full.item() == pytest.approx(expected, rel=1e-7, abs=1e-12)


def test_naive_per_microbatch_token_mean_differs_from_full_batch_when_token_counts_differ():
    loss = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    full = aggregate_loss(loss, mask, "token-mean")
    assert full.item() == pytest.approx(1.0 / 7.0)

    splits = [(0, 1), (1, 3)]  # 1 token vs 6 tokens
    naive = sum(aggregate_loss(loss[a:b], mask[a:b], "token-mean") for a, b in splits) / len(splits)
    assert naive.item() == pytest.approx(0.5)
    assert abs(naive.item() - full.item()) > 0.1

    norm = aggregation_normalizer(mask, "token-mean")
    correct = sum(aggregate_loss(loss[a:b], mask[a:b], "token-mean", normalizer=norm) for a, b in splits)
    assert correct.item() == pytest.approx(full.item(), rel=1e-12)


def test_naive_per_microbatch_token_mean_differs_on_random_batch():
    loss, mask = _batch(7, b=8, t=10, dtype=torch.float64)
    counts = [mask[a:b].sum().item() for a, b in MICRO_SPLITS]
    assert len(set(counts)) > 1
    full = aggregate_loss(loss, mask, "token-mean").item()
    naive = sum(aggregate_loss(loss[a:b], mask[a:b], "token-mean").item() for a, b in MICRO_SPLITS) / 3
    assert abs(naive - full) > 1e-3


def test_normalizer_accepts_python_float():
    loss, mask = _batch(8)
    out = aggregate_loss(loss, mask, "token-mean", normalizer=10.0)
    assert out.item() == pytest.approx((loss * mask).sum().item() / 10.0, rel=1e-6)


@pytest.mark.parametrize("mode", ["mean", "token_mean", "seq-mean", "sum", ""])
def test_unknown_aggregation_mode_raises_value_error(mode):
    loss, mask = _batch(0)
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, mode)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        aggregation_normalizer(mask, mode)  # type: ignore[arg-type]

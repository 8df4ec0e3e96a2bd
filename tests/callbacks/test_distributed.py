"""Batch statistics are reduced across ranks: two gloo processes select what one process selects on the whole batch."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr.callbacks import OPEFO, STEER, ClipCov, KLCov, PositionShaping, TopEntropyTokens
from lightning_rlvr.distributed import all_max, all_sum, all_union, gather_cat
from lightning_rlvr.metrics.entropy_analysis import BucketedMean, position_buckets, rank_buckets
from tests.two_ranks import two_rank_results

from .helpers import micro_context, step_context

pytestmark = pytest.mark.slow  # multi-process runs (deselect with -m "not slow")


def case():
    g = torch.Generator().manual_seed(0)
    rows, width = 8, 6
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width) < lengths.unsqueeze(-1)).float()
    adv = torch.randn(rows, generator=g) * 2
    old = -torch.rand(rows, width, generator=g) * 4
    logp = old + 0.3 * torch.randn(rows, width, generator=g)
    entropy = torch.rand(rows, width, generator=g) * 3
    return mask, adv, logp, old, entropy


def outputs(rows):
    """ClipCov weights, TopEntropyTokens weights and the KL-Cov term for ``rows`` of the case."""
    mask, adv, logp, old, entropy = case()
    step = step_context([0.0] * len(rows), mask[rows], advantages=adv[rows])
    normalizer = all_sum(mask[rows].sum())  # the module all-reduces the minibatch normaliser the same way
    ctx = micro_context(step, logp[rows], old[rows], entropy=entropy[rows], normalizer=normalizer)
    clip = ClipCov(ratio=0.3, seed=5).token_weights(None, None, ctx)
    top = TopEntropyTokens(ratio=0.25).token_weights(None, None, ctx)
    kl = KLCov(ratio=0.2).extra_loss(None, None, ctx)
    return clip, top, kl


def stage_outputs(rows):
    """PositionShaping with an entropy quantile, rank buckets of a per-row value, position-bucketed entropy."""
    mask, adv, logp, old, entropy = case()
    step = step_context([0.0] * len(rows), mask[rows], advantages=adv[rows], old_entropy=entropy[rows])
    shaped = PositionShaping(active_steps=None, active_fraction=None, entropy_quantile=0.6).shape_advantages(None, None, step)
    buckets = rank_buckets(adv[rows], 3)
    metric = BucketedMean(4)
    metric.update(entropy[rows], position_buckets(mask[rows], 4), mask[rows])
    return shaped, buckets, metric.compute()["mean"], all_max(adv[rows].max())


def steer_outputs(rows):
    """STEER weights in both modes (|Ω| extremes over all ranks), OPEFO weights (λ* over all ranks), metrics."""
    mask, adv, logp, old, entropy = case()
    step = step_context([0.0] * len(rows), mask[rows], advantages=adv[rows])
    ctx = micro_context(step, logp[rows], old[rows], entropy=entropy[rows])
    weights = [STEER(mode=mode).token_weights(None, None, ctx) for mode in ("exp", "linear")]
    sbar = 0.05 * entropy[rows] / 3
    flow_ctx = micro_context(step, logp[rows], old[rows], entropy=entropy[rows], sbar=sbar)
    weights.append(OPEFO(strict_on_policy=False).token_weights(None, None, flow_ctx))  # λ* from all ranks' flows
    return weights, {k: v for k, v in step.metrics.means().items() if k.startswith(("steer/", "opefo/"))}


def rank_outputs(rank: int) -> dict:
    values, offset = gather_cat(torch.arange(3 + rank, dtype=torch.float32) + 10 * rank)
    names = all_union({"correct", "format"} if rank == 0 else {"correct", "length"})  # reward components
    rows = torch.arange(4) + 4 * rank
    clip, top, kl = outputs(rows)
    kl_sum = all_sum(kl.detach())  # the ranks' losses add up to the whole batch's
    shaped, buckets, by_position, max_adv = stage_outputs(rows)
    steer, steer_metrics = steer_outputs(rows)
    return {"values": values, "offset": offset, "names": names, "clip": clip, "top": top, "kl_sum": kl_sum,
            "shaped": shaped, "buckets": buckets, "by_position": by_position, "max_adv": max_adv, "steer": steer,
            "steer_metrics": steer_metrics}


def test_two_ranks_select_the_same_tokens_as_one_process_on_the_whole_batch(tmp_path):
    ranks = two_rank_results(rank_outputs, tmp_path)
    expected_values = torch.tensor([0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 13.0])
    for r, result in enumerate(ranks):
        assert torch.equal(result["values"], expected_values)
        assert result["offset"] == 3 * r
        assert result["names"] == {"correct", "format", "length"}  # every rank logs every component's name

    clip, top, kl = outputs(torch.arange(8))
    assert (clip == 0).any() and (top > 0).any()
    torch.testing.assert_close(torch.cat([r["clip"] for r in ranks]), clip)
    torch.testing.assert_close(torch.cat([r["top"] for r in ranks]), top)
    torch.testing.assert_close(ranks[0]["kl_sum"], kl.detach())

    shaped, buckets, by_position, max_adv = stage_outputs(torch.arange(8))
    assert (shaped != case()[1].unsqueeze(-1)).any()
    torch.testing.assert_close(torch.cat([r["shaped"] for r in ranks]), shaped)
    assert torch.equal(torch.cat([r["buckets"] for r in ranks]), buckets)
    for result in ranks:  # torchmetrics compute() syncs the sum states: every rank gets the global means
        torch.testing.assert_close(result["by_position"], by_position, equal_nan=True)
        torch.testing.assert_close(result["max_adv"], max_adv)

    steer, steer_metrics = steer_outputs(torch.arange(8))
    assert (steer[2] != 1).any()
    for mode in range(3):
        torch.testing.assert_close(torch.cat([r["steer"][mode] for r in ranks]), steer[mode])
    for result in ranks:  # the metrics (mean, min, max, clip fractions) are those of the whole batch
        assert result["steer_metrics"].keys() == steer_metrics.keys()
        for key, value in steer_metrics.items():
            assert abs(result["steer_metrics"][key] - value) < 1e-6, key

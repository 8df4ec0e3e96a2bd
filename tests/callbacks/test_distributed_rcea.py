"""RCEA metrics, PAEC, HAPO and EP-GRPO under 2-process gloo DDP equal one process on the same data."""

from __future__ import annotations

import pytest
import torch

from lightning_rlvr.callbacks import EPGRPO, HAPO, PAEC
from lightning_rlvr.distributed import all_sum
from lightning_rlvr.metrics.rcea import CovarianceTailConcentration, PairedEntropyRatio, StratifiedEntropy
from tests.two_ranks import two_rank_results

from .helpers import micro_context, step_context

pytestmark = pytest.mark.slow  # multi-process runs (deselect with -m "not slow")

ROWS, WIDTH = 8, 6
GROUPS = [0, 0, 1, 1, 2, 2, 3, 3]  # a group never straddles ranks (the module shards whole groups)


def data(update: int):
    g = torch.Generator().manual_seed(10 + update)
    mask = (torch.arange(WIDTH) < torch.randint(1, WIDTH + 1, (ROWS, 1), generator=g)).float()
    correct = torch.tensor([True, False] * 4) if update == 0 else torch.rand(ROWS, generator=g) < 0.5
    entropy = torch.rand(ROWS, WIDTH, generator=g) * 2
    questions = torch.randint(0, 5, (ROWS,), generator=g)
    cov = torch.randn(ROWS, WIDTH, generator=g)
    return mask, correct, entropy, questions, cov


def metric_outputs(rows):
    metrics = StratifiedEntropy(), PairedEntropyRatio(num_resamples=300, seed=1), CovarianceTailConcentration()
    for update in range(2):  # multi-batch: two updates before compute
        mask, correct, entropy, questions, cov = data(update)
        metrics[0].update(entropy[rows], mask[rows], correct[rows])
        metrics[1].update(entropy[rows], mask[rows], correct[rows], questions[rows])
        metrics[2].update(cov[rows], mask[rows], correct[rows])
    return [{k: v.item() for k, v in m.compute().items()} for m in metrics]


def intervention_outputs(rows):
    mask, correct, entropy, _, _ = data(0)
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(ROWS, generator=g)
    old_logprobs = -torch.rand(ROWS, WIDTH, generator=g) * 3
    ref = old_logprobs + 0.2 * torch.randn(ROWS, WIDTH, generator=g)
    sbar = 0.05 * torch.rand(ROWS, WIDTH, generator=g)
    nucleus, gap = torch.rand(ROWS, WIDTH, generator=g) * 2, torch.rand(ROWS, WIDTH, generator=g) * 3
    rewards = correct.float()[rows].tolist()
    out = {}
    for cls in (HAPO, EPGRPO):
        step = step_context(rewards, mask[rows], advantages=advantages[rows],
                            group_ids=torch.tensor(GROUPS)[rows] - min(GROUPS[r] for r in rows.tolist()),
                            old_logprobs=old_logprobs[rows], old_entropy=entropy[rows])
        step.old_sbar, step.ref_logprobs = sbar[rows], ref[rows]
        out[cls.__name__] = (cls().shape_advantages(None, None, step), step.metrics.means())
    step = step_context(rewards, mask[rows], advantages=advantages[rows])
    h = entropy[rows].clone().requires_grad_(True)
    mctx = micro_context(step, old_logprobs[rows], entropy=h)
    mctx.nucleus_entropy, mctx.top2_gap = nucleus[rows], gap[rows]
    paec = PAEC()
    paec.anchor_sum, paec.anchor_count = 4 * 5.0, 4  # floor 4.5 above the entropy: the hinge is active
    term = paec.extra_loss(None, None, mctx)
    term.backward()
    out["PAEC"] = (all_sum(term.detach()), h.grad, step.metrics.means())
    return out


def rank_outputs(rank: int) -> dict:
    rows = torch.arange(4) + 4 * rank
    return {"metrics": metric_outputs(rows), "interventions": intervention_outputs(rows)}


def test_two_ranks_equal_one_process(tmp_path):
    ranks = two_rank_results(rank_outputs, tmp_path)
    single_metrics = metric_outputs(torch.arange(ROWS))
    assert single_metrics[1]["paired"] > 0
    for result in ranks:  # compute() on every rank gives the whole data's value
        for got, expected in zip(result["metrics"], single_metrics):
            assert got.keys() == expected.keys()
            for key in expected:
                torch.testing.assert_close(torch.tensor(got[key]), torch.tensor(expected[key]), equal_nan=True,
                                           rtol=1e-9, atol=1e-12)
    single = intervention_outputs(torch.arange(ROWS))
    for name in ("HAPO", "EPGRPO"):
        torch.testing.assert_close(torch.cat([r["interventions"][name][0] for r in ranks]), single[name][0])
        for result in ranks:
            for key, value in single[name][1].items():
                torch.testing.assert_close(torch.tensor(result["interventions"][name][1][key]), torch.tensor(value),
                                           equal_nan=True, rtol=1e-5, atol=1e-7)
    term, grad, paec_metrics = single["PAEC"]
    assert paec_metrics["paec/below_floor"] == 1
    for result in ranks:
        torch.testing.assert_close(result["interventions"]["PAEC"][0], term.detach())
    torch.testing.assert_close(torch.cat([r["interventions"]["PAEC"][1] for r in ranks]), grad)

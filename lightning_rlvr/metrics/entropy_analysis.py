"""Token-weighted means by bucket (position decile, perplexity bucket, response polarity), distributed-correct.

The analyses of arXiv 2508.02260 split token entropy (and its change) by where a token sits in its
response and by the perplexity of the response. :class:`BucketedMean` keeps per-bucket sums and counts
(``dist_reduce_fx="sum"``: the mean over all ranks is the ratio of the summed states, never a mean of
means); :func:`bucketed_mean` is its functional twin. Bucket assignments:

- :func:`position_buckets`: ``floor(B · (t + ½)/|o|)`` for the ``t``-th token of a response of length
  ``|o|``: the token's *centred* relative position, so the first and last tokens are symmetric (with the
  authors' ``(cumsum − 1)/|o|`` the last token never reaches the top bucket of a short response).
- :func:`rank_buckets`: equal-count buckets of a per-response value over **all ranks** (rank in the
  globally sorted order, ties by rank order then row), bucket 0 = smallest.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_rlvr.distributed import gather_cat

__all__ = ["BucketedMean", "bucketed_mean", "position_buckets", "rank_buckets"]


def bucketed_mean(values: Tensor, buckets: Tensor, num_buckets: int, weights: Tensor | None = None) -> Tensor:
    """``(num_buckets,)`` weighted mean of ``values`` in each bucket (``nan`` for an empty bucket)."""
    sums, counts = _bucket_sums(values, buckets, num_buckets, weights)
    return torch.where(counts > 0, sums / counts.clamp_min(1e-30), torch.full_like(sums, float("nan")))


def _bucket_sums(values: Tensor, buckets: Tensor, num_buckets: int, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    values = values.detach().reshape(-1).float()
    buckets = buckets.reshape(-1).long()
    weights = torch.ones_like(values) if weights is None else weights.detach().reshape(-1).float()
    keep = weights != 0
    if ((buckets[keep] < 0) | (buckets[keep] >= num_buckets)).any():
        raise ValueError(f"bucket index outside [0, {num_buckets})")
    buckets = buckets.clamp(0, num_buckets - 1)
    sums = torch.zeros(num_buckets, dtype=values.dtype, device=values.device).index_add_(0, buckets, values * weights)
    counts = torch.zeros(num_buckets, dtype=weights.dtype, device=values.device).index_add_(0, buckets, weights)
    return sums, counts


class BucketedMean(Metric):
    """Weighted mean per bucket over every ``update`` (and every rank).

    ``compute()`` returns ``{"mean": (B,), "sum": (B,), "count": (B,)}`` (``nan`` mean for an empty bucket).

    Example::

        >>> import torch
        >>> m = BucketedMean(2)
        >>> m.update(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 1]))
        >>> m.compute()["mean"]
        tensor([2., 5.])
    """

    full_state_update = False

    def __init__(self, num_buckets: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if num_buckets < 1:
            raise ValueError(f"BucketedMean: num_buckets must be >= 1, got {num_buckets}")
        self.num_buckets = num_buckets
        self.add_state("sums", torch.zeros(num_buckets, dtype=torch.float32), dist_reduce_fx="sum")
        self.add_state("counts", torch.zeros(num_buckets, dtype=torch.float32), dist_reduce_fx="sum")

    def update(self, values: Tensor, buckets: Tensor, weights: Tensor | None = None) -> None:
        sums, counts = _bucket_sums(values, buckets, self.num_buckets, weights)
        self.sums += sums.to(self.sums.device)
        self.counts += counts.to(self.counts.device)

    def compute(self) -> dict[str, Tensor]:
        nan = torch.full_like(self.sums, float("nan"))
        return {"mean": torch.where(self.counts > 0, self.sums / self.counts.clamp_min(1e-30), nan),
                "sum": self.sums.clone(), "count": self.counts.clone()}


def position_buckets(mask: Tensor, num_buckets: int = 10) -> Tensor:
    """``(N, T)`` bucket of each valid token's centred relative position (0 off the mask)."""
    mask = mask.float()
    length = mask.sum(-1, keepdim=True).clamp_min(1.0)
    centred = (mask.cumsum(-1) - 0.5) / length
    return (centred * num_buckets).floor().clamp(0, num_buckets - 1).long() * (mask > 0)


def rank_buckets(values: Tensor, num_buckets: int) -> Tensor:
    """``(N,)`` equal-count bucket of each local value among the values of all ranks (0 = smallest)."""
    everything, offset = gather_cat(values.detach().float().reshape(-1))
    n = everything.numel()
    order = torch.sort(everything, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(n, device=order.device)
    buckets = rank * num_buckets // max(n, 1)
    return buckets[offset : offset + values.numel()].reshape(values.shape)

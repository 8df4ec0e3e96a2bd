"""TopEntropyTokens: policy gradient only through the highest-entropy ("forking") tokens.

Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective RLVR"
(arXiv 2506.01939; code ``get_global_entropy_top_mask``). Among the valid tokens of the minibatch (on all ranks;
``scope="micro_batch"``: of each micro-batch, as the reference code's per-device batches), keep the
``k = max(1, ⌈ρ · N⌉)`` with the largest current-policy entropy (ties: the earlier token) and zero the pg loss
elsewhere. The reference aggregates over the *selected* tokens,
``agg(L, mask · top_mask)`` (token-mean: divided by the number selected, a per-token scale ~1/ρ).
With ``renormalize=True`` (default) the kept tokens are weighted by ``N / k`` so the module's token-mean normaliser
gives exactly that; ``False`` keeps the all-token denominator.
Only the policy-gradient term is masked (KL and entropy terms are not, as in the reference).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor
from typing_extensions import override

from lightning_rlvr.algorithms.selection import top_fraction_mask
from lightning_rlvr.callbacks.base import Intervention, MicroBatchContext, MinibatchView, StatisticsScope

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["TopEntropyTokens"]


class TopEntropyTokens(Intervention):
    """Train only on the top-``ratio`` entropy tokens (the 80/20 rule).

    Args:
        ratio: ρ, the kept fraction of valid tokens (paper 0.2).
        renormalize: weight kept tokens by ``N / k`` (the reference's denominator: the selected tokens).
        scope: the tokens ranked: ``"minibatch"`` (independent of ``micro_batch_size``) or ``"micro_batch"``.

    Example::

        >>> from lightning_rlvr.callbacks import TopEntropyTokens
        >>> TopEntropyTokens(ratio=0.2).state_key
        "TopEntropyTokens{'ratio': 0.2, 'renormalize': True}"
    """

    metric_prefix = "top_entropy"

    def __init__(self, ratio: float = 0.2, renormalize: bool = True, scope: StatisticsScope = "minibatch") -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"TopEntropyTokens: ratio must be in (0, 1], got {ratio}")
        self.needs = self._statistics_scope(scope)
        self.ratio = float(ratio)
        self.renormalize = bool(renormalize)

    @property
    @override
    def state_key(self) -> str:
        return self._state_key(ratio=self.ratio, renormalize=self.renormalize)

    @override
    def token_weights(self, trainer: pl.Trainer, pl_module: pl.LightningModule, ctx: MicroBatchContext) -> Tensor:
        view, rows = ctx.statistics_view(self.scope)
        return view.once(self, lambda: self._weights(view, ctx))[rows]

    def _weights(self, view: MinibatchView, ctx: MicroBatchContext) -> Tensor:
        entropy, offset = view.gather_valid(view.entropy)
        selected = top_fraction_mask(entropy, self.ratio)
        n_selected, n_valid = int(selected.sum().item()), entropy.numel()
        weights = view.scatter_valid(selected, offset).to(view.mask.dtype)
        if self.renormalize and n_selected:
            weights = weights * (n_valid / n_selected)
        if n_selected:
            ctx.log(self.log_name("threshold"), entropy[selected].min().item())
            ctx.log(self.log_name("selected_entropy"), entropy[selected].mean().item())
            ctx.log(self.log_name("unselected_entropy"),
                    entropy[~selected].mean().item() if n_selected < n_valid else float("nan"))
            ctx.log(self.log_name("selected_fraction"), n_selected / n_valid)
        return weights

"""Fused hidden-state log-probs/entropy: equal to the full log_softmax of h W^T + b, gradients included, and no
tensor of N x V elements is ever created (checked op by op with a dispatch mode)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_rlvr.ops import naive_logprobs_and_entropy, nucleus_entropy_and_gap
from lightning_rlvr.ops.fused_logprobs import chunk_rows, hidden_logprobs_and_entropy, hidden_nucleus_entropy_and_gap


def make(n_rows=(3, 7), hidden_size=16, vocab=50, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*n_rows, hidden_size, generator=generator)
    weight = torch.randn(vocab, hidden_size, generator=generator) * 0.5
    b = torch.randn(vocab, generator=generator) if bias else None
    labels = torch.randint(0, vocab, n_rows, generator=generator)
    return hidden, weight, b, labels


def reference(hidden, weight, bias, labels, temperature):
    logits = hidden @ weight.T + (0 if bias is None else bias)
    return naive_logprobs_and_entropy(logits, labels, temperature)


@pytest.mark.parametrize("chunk_size", [1, 4, None])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False])
def test_values_equal_the_full_log_softmax(chunk_size, temperature, bias):
    hidden, weight, b, labels = make(bias=bias)
    ours = hidden_logprobs_and_entropy(hidden, weight, labels, temperature, chunk_size, with_sbar=True, bias=b)
    ref = reference(hidden, weight, b, labels, temperature)
    torch.testing.assert_close(ours.logprobs, ref.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.entropy, ref.entropy, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sbar, ref.sbar, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [2, None])
def test_gradients_equal_autograd_through_the_full_log_softmax(chunk_size):
    hidden, weight, b, labels = make()
    coef_logp = torch.randn(labels.shape, generator=torch.Generator().manual_seed(1))
    coef_entropy = torch.randn(labels.shape, generator=torch.Generator().manual_seed(2))
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    ours = hidden_logprobs_and_entropy(leaves[0], leaves[1], labels, 0.8, chunk_size, entropy_grad=True,
                                       bias=leaves[2])
    ((ours.logprobs * coef_logp).sum() + (ours.entropy * coef_entropy).sum()).backward()
    ref_leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    ref = reference(*ref_leaves, labels, 0.8)
    ((ref.logprobs * coef_logp).sum() + (ref.entropy * coef_entropy).sum()).backward()
    for mine, theirs in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-4, atol=1e-5)


def test_detached_entropy_passes_no_gradient_and_logprob_gradient_matches():
    hidden, weight, b, labels = make(bias=False)
    leaf = hidden.clone().requires_grad_()
    ours = hidden_logprobs_and_entropy(leaf, weight, labels)
    assert not ours.entropy.requires_grad
    ours.logprobs.sum().backward()
    ref_leaf = hidden.clone().requires_grad_()
    reference(ref_leaf, weight, None, labels, 1.0).logprobs.sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-4, atol=1e-6)


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_n_by_v_tensor_is_ever_created_forward_or_backward():
    hidden, weight, b, labels = make(n_rows=(4, 64), hidden_size=8, vocab=1000)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, b)]
    with _LargestTensor() as probe:
        stats = hidden_logprobs_and_entropy(leaves[0], leaves[1], labels, chunk_size=16, entropy_grad=True,
                                            bias=leaves[2])
        (stats.logprobs.sum() + stats.entropy.sum()).backward()
    n_by_v = labels.numel() * weight.shape[0]
    assert probe.largest <= 16 * weight.shape[0] < n_by_v // 10


def test_nucleus_statistics_equal_those_of_the_full_logits():
    hidden, weight, b, _ = make(vocab=200)
    ours = hidden_nucleus_entropy_and_gap(hidden, weight, 0.9, 0.8, chunk_size=5, bias=b)
    theirs = nucleus_entropy_and_gap(hidden @ weight.T + b, 0.9, 0.8)
    for mine, reference_value in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, reference_value, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_give_float32_stats_close_to_the_float32_result():
    hidden, weight, _, labels = make(bias=False)
    ours = hidden_logprobs_and_entropy(hidden.bfloat16(), weight.bfloat16(), labels)
    ref = reference(hidden, weight, None, labels, 1.0)
    assert ours.logprobs.dtype == torch.float32
    torch.testing.assert_close(ours.logprobs, ref.logprobs, rtol=0.05, atol=0.1)


def test_chunk_rows_bounds_a_chunks_bytes():
    assert chunk_rows(151_936, 32 << 20) == (32 << 20) // (4 * 151_936)
    assert chunk_rows(10**9) == 1


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": 0.0}, "temperature"),
    ({"chunk_size": 0}, "chunk_size"),
])
def test_bad_arguments_are_refused(kwargs, message):
    hidden, weight, _, labels = make(bias=False)
    with pytest.raises(ValueError, match=message):
        hidden_logprobs_and_entropy(hidden, weight, labels, **kwargs)


def test_mismatched_shapes_are_refused():
    hidden, weight, _, labels = make(bias=False)
    with pytest.raises(ValueError, match="labels"):
        hidden_logprobs_and_entropy(hidden, weight, labels[:, :-1])
    with pytest.raises(ValueError, match="weight"):
        hidden_logprobs_and_entropy(hidden, weight[:, :-1], labels)

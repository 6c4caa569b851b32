"""Unit tests of tl_steering.metrics (float64 next-token loss, KL, entropy, top-1) and batching.mean_loss.

References are written here from the definitions in docs/metrics.md; tolerances are float64 round-off (1e-12)
unless stated.
"""

import math

import pytest
import torch

from tl_steering import metrics
from tl_steering.backends import adapt
from tl_steering.data.batching import mean_loss
from tl_steering.errors import InputError
from tl_steering.hooks import ffn_component

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def logits_and_tokens(seed: int = 0, b: int = 3, p: int = 6, v: int = 11):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, p, v, generator=g) * 3, torch.randint(0, v, (b, p), generator=g)


def test_next_token_loss_is_the_float64_cross_entropy():
    logits, tokens = logits_and_tokens()
    got = metrics.next_token_loss(logits, tokens)
    assert got.dtype == torch.float64 and got.shape == (3, 5)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].double().reshape(-1, 11), tokens[:, 1:].reshape(-1),
                                            reduction="none").reshape(3, 5)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    # a one-hot-like prediction costs ~0 nats, a uniform one log(vocab)
    flat = torch.zeros(1, 2, 11)
    assert metrics.next_token_loss(flat, torch.tensor([[0, 4]])).item() == pytest.approx(math.log(11), abs=1e-12)


def test_kl_entropy_and_top1_match_their_definitions():
    lp, _ = logits_and_tokens(1)
    lq, _ = logits_and_tokens(2)
    p, q = torch.softmax(lp.double(), -1), torch.softmax(lq.double(), -1)
    kl = metrics.kl_divergence(lp, lq)
    assert kl.shape == (3, 6) and kl.dtype == torch.float64
    assert torch.allclose(kl, (p * (p.log() - q.log())).sum(-1), rtol=0, atol=1e-12)
    assert (kl > 0).all() and torch.equal(metrics.kl_divergence(lp, lp), torch.zeros(3, 6, dtype=torch.float64))
    assert torch.allclose(metrics.entropy(lp), -(p * p.log()).sum(-1), rtol=0, atol=1e-12)
    assert metrics.entropy(torch.zeros(4, 8)).tolist() == pytest.approx([math.log(8)] * 4, abs=1e-12)
    assert torch.equal(metrics.top1(lp), p.argmax(-1))
    agree = metrics.top1_agreement(lp, lq)
    assert torch.equal(agree, (p.argmax(-1) == q.argmax(-1)).double())


def test_chunking_does_not_change_the_numbers_and_keeps_gradients(monkeypatch):
    logits, tokens = logits_and_tokens(3, b=5)

    def five():
        return (metrics.next_token_loss(logits, tokens), metrics.kl_divergence(logits, logits.flip(0)),
                metrics.entropy(logits), metrics.entropy(logits[0]), metrics.entropy(logits[:0]))

    monkeypatch.setattr(metrics, "CACHE_ELEMENTS", 1 << 40)
    whole = five()
    monkeypatch.setattr(metrics, "CACHE_ELEMENTS", 2 * 11)  # two rows of logits a chunk (one thread; KL: one row)
    chunked = five()
    monkeypatch.undo()
    for a, b in zip(whole, chunked):  # each row's log-softmax is the same; a sum over 11 values may change order
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float64
        assert torch.allclose(a, b, rtol=16 * 11 * torch.finfo(torch.float64).eps, atol=0)
    x = logits.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(metrics.next_token_loss(x, tokens).sum(), [x])
    assert g.shape == x.shape and torch.isfinite(g).all() and g[:, -1].abs().max() == 0  # last position predicts nothing
    ref = -torch.log_softmax(x[:, :-1].double(), -1).gather(-1, tokens[:, 1:, None]).sum()
    (g_ref,) = torch.autograd.grad(ref, [x])
    assert torch.allclose(g, g_ref, rtol=1e-12, atol=1e-15)


def test_bad_shapes_raise_input_error():
    logits, tokens = logits_and_tokens()
    with pytest.raises(InputError, match="must agree"):
        metrics.next_token_loss(logits, tokens[:, :-1])
    with pytest.raises(InputError, match="same shape"):
        metrics.kl_divergence(logits, logits[:, :-1])


def test_mean_loss_weighs_every_token_the_same_whatever_the_batching(tiny, tiny_tokens):
    ad = adapt(tiny)
    per_token = ad.loss_per_token(tiny_tokens)
    expected = float(per_token.sum() / per_token.numel())
    for batch_size in (1, 2, tiny_tokens.shape[0]):
        assert mean_loss(tiny, tiny_tokens, batch_size=batch_size) == pytest.approx(expected, abs=1e-6)
    hooks = ffn_component(tiny, keep="zero")
    patched = float(ad.loss_per_token(tiny_tokens, hooks).mean())
    assert mean_loss(ad, tiny_tokens, hooks, batch_size=3) == pytest.approx(patched, abs=1e-6)

"""Prefix sharing of the plan losses (tl_steering.parallel.gold.PlanLoss): a plan run from the clean residual
entering its first parallel layer gives the same mean CE as the whole hooked forward, on every tiny architecture and
backend; it turns itself off where it would be wrong (a hook of the user's on the model) or too big."""

import pytest
import torch

from tl_steering.backends import adapt, hook_guard
from tl_steering.parallel import gold
from tl_steering.parallel.gold import PlanLoss
from tl_steering.parallel.refit import FittedLoss, RefitLoss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLANS = [[], [0], [1], [0, 1], [1, 0]]


def _tokens(n: int = 5, pos: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, 257, (n, pos), generator=g)


def test_shared_prefix_equals_the_hooked_forward(tiny):
    toks = _tokens()
    shared, plain = PlanLoss(tiny, toks, batch_size=2), PlanLoss(tiny, toks, batch_size=2, share_prefix=False)
    for plan in PLANS:
        # same sublayers, same order of operations: equal to float32 roundoff of the CE (in practice bit-equal)
        assert shared(plan) == pytest.approx(plain(plan), abs=1e-6)
    assert shared.prefix_note == "" and shared._prefix is not None
    assert plain._prefix is None
    assert shared.passes == plain.passes == len({tuple(sorted(p)) for p in PLANS})
    # the suffix really runs: a plan that changes the model changes the loss (NeoX: parallel already, no change)
    if not adapt(tiny).any_parallel:
        assert abs(shared.delta([0])) > 1e-6


def test_clean_pass_builds_the_prefix_once(tiny):
    pl = PlanLoss(tiny, _tokens(), batch_size=4)
    pl([1])  # builds the prefix: the clean CE comes with it
    assert () in pl.memo and pl.passes == 2
    assert pl.clean == pytest.approx(PlanLoss(tiny, _tokens(), batch_size=4, share_prefix=False).clean, abs=1e-7)
    assert pl.passes == 2  # the clean plan was not run again


def test_a_user_hook_turns_sharing_off(tiny):
    """The shared path calls sublayers with hooks silenced: with a hook of the user's on the model, every plan runs
    the hooked forward, so the user's hook acts (here: it scales the embedding output)."""
    ad = adapt(tiny)
    name = ad.hook_name(0, "resid_pre")
    toks = _tokens()
    with hook_guard(ad.model):  # removes the hook again on exit
        tiny.add_hook(name, lambda act, hook: act * 0.5)
        pl = PlanLoss(tiny, toks, batch_size=2)
        with_hook = pl([1])
        assert "hooks of its own" in pl.prefix_note and pl._prefix is None
    assert with_hook != pytest.approx(PlanLoss(tiny, toks, batch_size=2)([1]), abs=1e-4)


def test_too_big_turns_sharing_off(tiny, monkeypatch):
    monkeypatch.setattr(gold, "PREFIX_CACHE_BYTES", 1024)
    pl = PlanLoss(tiny, _tokens(), batch_size=2)
    ref = PlanLoss(tiny, _tokens(), batch_size=2, share_prefix=False)
    assert pl([0, 1]) == ref([0, 1])
    assert "PREFIX_CACHE_BYTES" in pl.prefix_note


def test_refit_losses_share_the_prefix(tiny):
    """The corrected plans (fitted on one set of windows, measured there and on others) through the shared prefix
    equal the hooked forwards: the same gates and biases, the same losses."""
    cal, held = _tokens(4, 16), _tokens(3, 16)[:, :16]
    a = RefitLoss(tiny, cal, batch_size=4)
    b = RefitLoss(tiny, cal, batch_size=4, share_prefix=False)
    for plan in ([1], [0, 1]):
        assert a(plan) == pytest.approx(b(plan), abs=1e-6)
        ga, ba, _ = a.fitted(plan)
        gb, bb, _ = b.fitted(plan)
        assert ga.keys() == gb.keys() and all(abs(ga[k] - gb[k]) < 1e-5 for k in ga)
        assert all(torch.allclose(ba[k], bb[k], rtol=1e-4, atol=1e-6) for k in ba)
        fa, fb = FittedLoss(tiny, held, 4, source=a), FittedLoss(tiny, held, 4, source=b, share_prefix=False)
        assert fa(plan) == pytest.approx(fb(plan), abs=1e-6)


def test_one_clean_pass_per_set_of_windows(tiny):
    """A cross-fitted loss's halves take their clean prefix from its rows and a loss given ``share_clean`` takes the
    other's: no clean pass of their own, the same losses as with passes of their own."""
    cal = _tokens(4, 16)
    a = RefitLoss(tiny, cal, batch_size=4, refit="linear")  # cross-fitted: the halves are RefitLosses of their own
    b = RefitLoss(tiny, cal, batch_size=4, refit="linear", share_prefix=False)
    plain, plain_ref = PlanLoss(tiny, cal, batch_size=4), PlanLoss(tiny, cal, batch_size=4, share_prefix=False)
    plain.share_clean(a)
    for plan in ([1], [0, 1]):
        assert a(plan) == pytest.approx(b(plan), abs=1e-6)
        assert plain(plan) == pytest.approx(plain_ref(plan), abs=1e-6)
    if adapt(tiny).any_parallel:  # NeoX: nothing sequential to fit or run
        return
    storage = a._prefix[1].untyped_storage().data_ptr()
    for fold in [*a._folds, plain]:
        assert fold._prefix[1].untyped_storage().data_ptr() == storage and fold._counted[()] == 0
    assert plain.passes == 2  # the two plans; the clean pass was a's


def test_a_suite_run_shares_plain_plans_between_losses(tiny):
    """Inside a suite run (shared_clean_forwards) a plain plan measured on some windows is not measured again on
    windows among them (no pass; the same block sums, equal to a fresh loss's up to the rounding of another batch); a
    corrected plan (RefitLoss) and other windows are measured."""
    from tl_steering._util.progress import reporting
    from tl_steering.backends.adapter import shared_clean_forwards

    toks = _tokens(5, 16)
    part = toks[1:4]
    fresh = PlanLoss(tiny, part, batch_size=2)
    expected = {plan: fresh.delta(plan) for plan in ((1,), (0, 1))}
    assert fresh.passes == 3
    with shared_clean_forwards(tiny):
        whole = PlanLoss(tiny, toks, batch_size=5)
        whole.prefetch([[1], [0, 1]])
        reused, shuffled = PlanLoss(tiny, part, batch_size=2), PlanLoss(tiny, toks[[3, 0]], batch_size=2)
        with reporting(lambda _: None) as fw:
            for plan, value in expected.items():
                assert reused.delta(plan) == pytest.approx(value, abs=1e-6)
                assert torch.equal(reused.blocks[plan], whole.blocks[plan][1:4])
            assert torch.equal(shuffled.delta_blocks([1]), whole.delta_blocks([1])[[3, 0]])  # windows in any order
        assert fw.forwards == 0
        assert reused.passes == fresh.passes == 3  # counted as the passes they stand for
        other = PlanLoss(tiny, toks.flip(-1)[:3], batch_size=2)
        other([1])
        assert other.passes == 2  # its clean pass and the plan
        refit = RefitLoss(tiny, part, batch_size=4, refit="gate")
        refit([1])
        assert (1,) in refit._fits  # fitted and measured here


def test_run_blocks_and_batch_slices_refuse_bad_input(tiny):
    from tl_steering.errors import InputError, LayerIndexError
    from tl_steering.data.sharding import batch_slices

    ad = adapt(tiny)
    x = torch.zeros(1, 4, ad.d_model)
    with pytest.raises((InputError, LayerIndexError), match="start"):
        ad.run_blocks(x, ad.n_layers)
    with pytest.raises(InputError, match="d_model"):
        ad.run_blocks(x[0], 0)
    assert batch_slices(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    for bad in (0, 1.5, True):
        with pytest.raises(InputError, match="batch_size"):
            batch_slices(5, bad)

"""tl_steering._util.progress: per-forward ticks with tokens/s from every forward that goes through the adapter.

Asserts exact forward and token counts on a tiny model, nesting, throttling, the final report, and that nothing
is counted (or called) outside a reporting block. Cost: well under a second per tiny model.
"""

import pytest
import torch

from tl_steering._util import progress
from tl_steering.backends import adapt

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_adapter_forward_ticks_with_its_tokens(tiny, tiny_tokens):
    ad = adapt(tiny)
    seen = []
    with progress.reporting(lambda s: seen.append((s.forwards, s.tokens)), min_interval=0.0) as stats:
        ad.run_with_hooks(tiny_tokens)
        ad.loss_per_token(tiny_tokens[:2])
        ad.run_with_cache(tiny_tokens[:1], [ad.hook_name(0, "resid_pre")])
    n = tiny_tokens.shape[1]
    assert (stats.forwards, stats.tokens) == (3, (3 + 2 + 1) * n)
    assert seen[:3] == [(1, 3 * n), (2, 5 * n), (3, 6 * n)]  # one call per forward (min_interval 0) ...
    assert seen[-1] == (3, 6 * n)  # ... and the end of the block reports the final state at most once more
    assert len(seen) in (3, 4)
    assert stats.seconds > 0 and stats.tokens_per_s == pytest.approx(stats.tokens / stats.seconds)
    assert stats.note().startswith("3 fwd, ") and stats.note().endswith(" tok/s")


def test_nesting_throttling_and_nothing_outside(tiny, tiny_tokens):
    ad = adapt(tiny)
    ad.run_with_hooks(tiny_tokens)  # outside any block: no error, nothing to count
    outer_calls, inner_calls = [], []
    with progress.reporting(lambda s: outer_calls.append(s.forwards), min_interval=1e9) as outer:
        ad.run_with_hooks(tiny_tokens)
        with progress.reporting(lambda s: inner_calls.append(s.forwards), min_interval=1e9) as inner:
            for _ in range(3):
                ad.run_with_hooks(tiny_tokens[:1])
        assert (inner.forwards, inner.tokens) == (3, 3 * tiny_tokens.shape[1])
        assert inner_calls == [1, 3]  # throttled: the first forward, then the end of the block
    assert (outer.forwards, outer.tokens) == (4, 6 * tiny_tokens.shape[1])
    assert outer_calls == [1, 4]
    with progress.reporting(lambda s: pytest.fail("called without a forward")):
        pass
    progress.forward_done(10)  # no block open: nothing happens
    assert outer.forwards == 4


def test_a_raising_forward_is_not_counted_and_the_block_closes(tiny):
    ad = adapt(tiny)
    def boom(act, hook):
        raise RuntimeError("hook failed")

    with progress.reporting(lambda s: None) as stats:
        with pytest.raises(RuntimeError, match="hook failed"):
            ad.run_with_hooks(torch.zeros(1, 4, dtype=torch.long), fwd_hooks=[(ad.hook_name(0, "resid_pre"), boom)])
    assert stats.forwards == 0
    assert progress._current.get() is None

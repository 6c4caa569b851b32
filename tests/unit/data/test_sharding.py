"""The per-window gather of the sharded report (tl_steering.data.sharding.gather_rows) without a process group: the
collective is replaced by the payloads two ranks would exchange."""

import torch

from tl_steering.data import sharding
from tl_steering.data.sharding import World, gather_rows


def test_a_rank_without_a_batch_gets_every_key_and_row(monkeypatch):
    """One batch of 4 windows: rank 0 runs it and made the arrays; rank 1 ran no batch and made none (a protocol
    that creates its sums on the first batch). Both end with rank 0's arrays, the same keys in the same order."""
    full = {"b": torch.arange(8, dtype=torch.float64).reshape(4, 2), "a": torch.ones(4, 3, dtype=torch.float32)}
    sent: list = []

    def exchange(payload, w):
        sent.append(payload)
        return [sent[0], sent[1]] if len(sent) == 2 else [payload, {}]

    monkeypatch.setattr(sharding, "gather_objects", exchange)
    on_0 = gather_rows(full, [slice(0, 4)], World(rank=0, size=2, backend="gloo"))  # rank 1 sends {}
    on_1 = gather_rows({}, [], World(rank=1, size=2, backend="gloo"))  # rank 0's payload, then its own
    for got in (on_0, on_1):
        assert list(got) == ["b", "a"]
        for k, v in full.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_split_by_cost_balances_the_ranks_and_each_item_has_one_owner(monkeypatch):
    """``owners``: the costliest item first, to the rank with the least work (rank 0 starting with ``load``); every
    rank computes its own items of ``split_map`` and the list comes back in item order."""
    cost = [30.0, 1.0, 29.0, 2.0, 28.0, 3.0]
    # 30 -> 0, 29 -> 1, 28 -> 1 (29 < 30), then the small ones to rank 0: 36 against 57 (two of the three large ones
    # share a rank in any split)
    assert sharding.owners(cost, 2) == [0, 0, 1, 0, 1, 0]
    # rank 0 has 40 already: 30 and 29 go to rank 1, 28 to rank 0 (68), the small ones to rank 1 (65)
    assert sharding.owners(cost, 2, [40.0]) == [1, 1, 1, 1, 0, 1]
    assert sharding.owners([1.0, 1.0, 1.0], 3) == [0, 1, 2] and sharding.owners([], 2) == []
    done: dict[int, list] = {0: [], 1: []}
    sent: dict[int, dict] = {}

    def exchange(mine, w):  # what the other rank sends: its items (each computed where it belongs, asserted below)
        sent[w.rank] = mine
        return [sent.get(0, {1: 16}), sent.get(1, {0: 9, 2: 25})]

    monkeypatch.setattr(sharding, "gather_objects", exchange)
    for rank in (0, 1):
        out = sharding.split_map(lambda x, r=rank: done[r].append(x) or x * x, [3, 4, 5], World(rank, 2, "gloo"),
                                 cost=[1.0, 5.0, 2.0])
        assert out == [9, 16, 25]
    assert done == {0: [4], 1: [3, 5]} and sent == {0: {1: 16}, 1: {0: 9, 2: 25}}


def test_on_rank0_runs_now_and_hands_over_later():
    """One process: the value comes from the call it returns; an error is raised at once (no rank waits for it)."""
    seen = []
    hand = sharding.on_rank0(lambda: seen.append(1) or "t")
    assert seen == [1] and hand() == "t" and sharding.broadcast_from_rank0(lambda: 7) == 7
    try:
        sharding.on_rank0(lambda: 1 / 0)
    except ZeroDivisionError:
        pass
    else:
        raise AssertionError("the error of fn must be raised in one process")

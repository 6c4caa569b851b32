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

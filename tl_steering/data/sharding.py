"""Sharding work over the ranks of a ``torch.distributed`` job: the collect -> gather -> reduce pattern of the
distributed report (docs/scale_out.md, "The sharded report")."""

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..errors import InputError
from ..validation import as_int

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

__all__ = ["batch_slices", "World", "broadcast_from_rank0", "check_agreement", "gather_objects", "gather_rows", "my_batches", "on_rank0",
           "owners", "p2p_group", "rank_device", "recv_object", "send_object", "split_map", "world"]


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in a ``torch.distributed`` job (rank 0 of 1 when there is no process group)."""

    rank: int = 0
    size: int = 1
    backend: str = "none"

    @property
    def active(self) -> bool:
        return self.size > 1


def world() -> World:
    """The current process group, if one is initialized (``torch.distributed``), else a single process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), str(dist.get_backend()))
    return World()


def rank_device(device: str | None) -> str | None:
    """The device this rank runs on: under a process group a CUDA request becomes the rank's own GPU (the one
    :func:`tl_steering.probing.scan.init_from_env` selected, ``cuda:LOCAL_RANK``); otherwise ``device`` unchanged."""
    if device is not None and str(device).startswith("cuda") and world().active:
        return f"cuda:{torch.cuda.current_device()}"
    return device


def gather_objects(obj: Any, w: World | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``all_gather_object``; ``[obj]`` alone)."""
    w = w or World()  # None: a single process
    if not w.active:
        return [obj]
    out: list[Any] = [None] * w.size
    torch.distributed.all_gather_object(out, obj)
    return out


def batch_slices(n: int, batch_size: int) -> list[slice]:
    """Every row slice of ``n`` windows in batches of ``batch_size`` consecutive windows (the last one shorter)."""
    size = as_int(batch_size, "batch_size", minimum=1)  # any integer (numpy and torch integers too), not a float
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def my_batches(n: int, batch_size: int, w: World | None = None) -> list[slice]:
    """The row slices (batches of ``batch_size`` consecutive windows of ``n``) this rank processes."""
    w = w or World()
    return batch_slices(n, batch_size)[w.rank::w.size]


def gather_rows(arrays: dict[K, Tensor], mine: Sequence[slice], w: World | None = None) -> dict[K, Tensor]:
    """Complete per-window arrays (first dimension = window; this rank's values in its rows ``mine``, the others
    placeholders) with every rank's rows, the same keys on every rank in rank order of first appearance (a rank
    without a batch may hold none of them), on the CPU (docs/scale_out.md, "The sharded report")."""
    w = w or World()
    if not w.active:
        return arrays
    payload = {k: (tuple(v.shape), v.dtype, [(s.start, s.stop, v[s].detach().cpu()) for s in mine])
               for k, v in arrays.items()}
    out, parts = {k: v.detach().cpu().clone() for k, v in arrays.items()}, gather_objects(payload, w)
    for k, (shape, dtype, rows) in ((k, p) for part in parts for k, p in part.items()):
        dest = out[k] if k in out else out.setdefault(k, torch.zeros(shape, dtype=dtype))
        for start, stop, v in rows:
            dest[start:stop] = v
    return {k: out[k] for k in dict.fromkeys(k for part in parts for k in part)}


def split_map(fn: Callable[[T], Any], items: Sequence[T], w: World | None = None, cost: Sequence[float] | None = None,
              load: Sequence[float] = ()) -> list[Any]:
    """``[fn(x) for x in items]`` with item ``i`` computed on rank ``i % world_size``, or with ``cost`` (one number per
    item) on the rank :func:`owners` gives it, the list on every rank; ``load``: work ranks 0, 1, ... have already."""
    w = w or World()
    if not w.active:
        return [fn(x) for x in items]
    owner = owners(cost, w.size, load) if cost is not None else [i % w.size for i in range(len(items))]
    mine = {i: fn(x) for i, x in enumerate(items) if owner[i] == w.rank}
    merged = {i: v for part in gather_objects(mine, w) for i, v in part.items()}
    return [merged[i] for i in range(len(items))]


def owners(cost: Sequence[float], size: int, load: Sequence[float] = ()) -> list[int]:
    """The rank of each item: the costliest first, each to the rank with the least work so far (the lower rank on a
    tie), starting from ``load``; the same on every rank."""
    work, owner = [float(v) for v in load] + [0.0] * (size - len(load)), [0] * len(cost)
    for i in sorted(range(len(cost)), key=lambda i: (-cost[i], i)):
        owner[i] = min(range(size), key=lambda r: (work[r], r))
        work[owner[i]] += cost[i]
    return owner


def on_rank0(fn: Callable[[], T], w: World | None = None) -> Callable[[], T]:
    """Run ``fn`` now on rank 0 only; the call returned hands its value to every rank (``broadcast_object_list``), so
    other collective work may run in between; an exception on rank 0 is re-raised there, on every rank."""
    w = w or World()
    box: list[Any] = [None]
    if w.rank == 0:
        try:
            box[0] = ("ok", fn())
        except BaseException as e:  # noqa: BLE001 - handed to the other ranks, re-raised here too
            if not w.active:
                raise
            box[0] = ("error", e)

    def hand() -> T:
        if w.active:
            torch.distributed.broadcast_object_list(box, src=0)
        if box[0][0] == "error":
            raise box[0][1]
        return box[0][1]
    return hand


def broadcast_from_rank0(fn: Callable[[], T], w: World | None = None) -> T:
    """Run ``fn`` on rank 0 only and hand its return value to every rank (:func:`on_rank0`)."""
    return on_rank0(fn, w)()


def p2p_group(w: World) -> Any:
    """The group of :func:`send_object` / :func:`recv_object`: the default group under gloo, else one gloo group per
    process (NCCL moves CUDA tensors only), made by a collective first call before the first send on every rank."""
    global _GLOO
    if w.backend == "gloo":
        return None
    if _GLOO is None:
        _GLOO = torch.distributed.new_group(backend="gloo")
    return _GLOO


_GLOO: Any = None


def send_object(obj: Any, dst: int, tag: int, w: World) -> Callable[[], None]:
    """Start sending ``obj`` (:func:`tl_steering.results.to_bytes`, or an exception's type and message) to rank
    ``dst`` under ``tag``; returns the call that waits until it is sent (:func:`recv_object` with that ``tag``
    receives it, in any order relative to other tags)."""
    group = p2p_group(w)
    data = torch.frombuffer(bytearray(_pack(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    works = [torch.distributed.isend(size, dst, group=group, tag=2 * tag),
             torch.distributed.isend(data, dst, group=group, tag=2 * tag + 1)]

    def wait(_buffers: tuple = (data, size)) -> None:  # the buffers live until the sends are done
        for work in works:
            work.wait()

    return wait


def recv_object(src: int, tag: int, w: World) -> Any:
    """The object rank ``src`` sent under ``tag`` (:func:`send_object`); blocks until it has arrived."""
    group = p2p_group(w)
    size = torch.zeros(1, dtype=torch.int64)
    torch.distributed.recv(size, src, group=group, tag=2 * tag)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    torch.distributed.recv(data, src, group=group, tag=2 * tag + 1)
    return _unpack(data.numpy().tobytes())


def _pack(obj: Any) -> bytes:
    from ..results import to_bytes

    if isinstance(obj, BaseException):  # re-raised on the receiving rank: its class if the package or Python has it
        obj = {"__error__": [type(obj).__module__, type(obj).__qualname__, str(obj)]}
    return to_bytes(obj)


def _unpack(data: bytes) -> Any:
    import builtins

    from .. import errors
    from ..results import from_bytes

    obj = from_bytes(data)
    if isinstance(obj, dict) and "__error__" in obj:
        module, name, message = obj["__error__"]
        cls = getattr(errors if module == errors.__name__ else builtins if module == "builtins" else None, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            try:
                return cls(message)
            except Exception:  # noqa: BLE001 - a class whose constructor wants other arguments
                pass
        return RuntimeError(f"{name}: {message}")
    return obj


def check_agreement(settings: dict[str, Any], w: World | None = None) -> None:
    """Raise :class:`InputError` on every rank when the ranks were started with different settings/models."""
    w = w or world()
    everyone = gather_objects(settings, w)
    bad = sorted({k for other in everyone for k in set(other) | set(settings) if other.get(k) != everyone[0].get(k)})
    if bad:
        detail = "; ".join(f"{k}: " + ", ".join(f"rank {r}={everyone[r].get(k)!r}" for r in range(w.size))
                           for k in bad)
        raise InputError(f"the {w.size} ranks disagree on {', '.join(bad)} ({detail}); start every rank with the "
                         "same model, weights, corpus and settings")

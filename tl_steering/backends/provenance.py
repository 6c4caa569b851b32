"""A result's provenance, read from the model and the call (:func:`model_provenance`): the weight processing
(docs/loading.md, "Weight processing") and the user's hook points (docs/hooks.md, "The user's own hooks"), each
warned once."""

from typing import Any

import torch
from torch import Tensor

from . import ownership as _ownership
from .detect import tl_version
from .processing import warn_if_processed, warn_once


def model_provenance(ad: Any, tokens: Tensor | None, corpus: str | None, seed: int | None,
                     extra: dict[str, Any]) -> Any:
    from ..results import Provenance

    info = ad.info
    proc = ad.processing
    warn_if_processed(ad.model, proc)
    seen = extra.pop("user_hooks", None)  # a probe passes the user's hook points it saw during its forwards
    user_hooks = sorted(set(_ownership.active_user_hooks(ad.model)) | set(seen or ()))
    if user_hooks:
        warn_once(ad.model, ("user_hooks", tuple(user_hooks)),
                  f"hooks of yours are active on {len(user_hooks)} hook point(s) of this model ({', '.join(user_hooks)}): "
                  "tl_steering measures the model as they change it, not the plain model. Recorded in the result's "
                  "provenance (user_hooks); run outside your hooks() context (or model.reset_hooks()) to measure the "
                  "plain model.", stacklevel=4)
    # provenance is passed explicitly (corpus=, or a data.TokenWindows unpacked by the caller); tensors carry no tags
    corpus = corpus or "user tokens (pass corpus= or TokenWindows)"
    world_size = (torch.distributed.get_world_size()
                  if torch.distributed.is_available() and torch.distributed.is_initialized() else 1)
    return Provenance(
        model=info.name,
        model_revision=info.revision,
        tl_version=tl_version(),
        backend=ad.backend,
        processing=proc.label,
        processing_steps=list(proc.steps),
        user_hooks=user_hooks,
        corpus=str(corpus),
        n_sequences=int(tokens.shape[0]) if tokens is not None else 0,
        n_tokens=int(tokens.numel()) if tokens is not None else 0,
        seed=seed,
        dtype=str(ad.dtype).removeprefix("torch."),
        device=str(ad.device),
        world_size=world_size,
        extra=extra,
    )


__all__ = ["model_provenance"]

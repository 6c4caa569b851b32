"""A result's provenance, read from the model and the call (:func:`model_provenance`): the weight processing
(docs/loading.md, "Weight processing") and the user's hook points (docs/hooks.md, "The user's own hooks"), each
warned once."""

from typing import Any

import torch
from torch import Tensor

from . import ownership as _ownership
from .detect import tl_version
from .processing import warn_if_processed, warn_once
from ..errors import UserHooksWarning


def model_provenance(ad: Any, tokens: Tensor | None, corpus: str | None, seed: int | None,
                     extra: dict[str, Any]) -> Any:
    """Model, revision, TL version, backend, weight processing (:mod:`.processing`), the user's hook points during
    the call (:mod:`.ownership`; ``user_hooks=`` / ``interventions=`` in ``extra``: those a probe saw instead),
    corpus, seed, dtype, device, world size and ``extra`` options; warns once per model on a processed residual
    stream and once per set of user hooks."""
    from ..results import Provenance

    proc = ad.processing
    info = ad.info_with(proc)
    warn_if_processed(ad.model, proc)
    # a probe passes the user's hook points and the hook factories' hooks it saw during its own forwards: those
    # are the hooks its numbers were measured under (not the ones on the model when the result is read)
    seen = extra.pop("user_hooks", None)
    seen_interventions = extra.pop("interventions", None)
    user_hooks = sorted(_ownership.active_user_hooks(ad.model) if seen is None else set(seen))
    interventions = sorted(_ownership.active_interventions(ad.model) if seen_interventions is None
                           else set(seen_interventions))
    if user_hooks:
        shown = ", ".join(user_hooks[:3]) + (", …" if len(user_hooks) > 3 else "")
        warn_once(ad.model, ("user_hooks", tuple(user_hooks)),
                  f"{len(user_hooks)} hook point(s) carry hooks not made by tl_steering ({shown}): the result measures "
                  "the model as they change it (recorded in provenance.user_hooks). Silence: warnings.filterwarnings("
                  "'ignore', category=tl_steering.errors.UserHooksWarning).", stacklevel=4, category=UserHooksWarning)
    # provenance is passed explicitly (corpus=, or a data.TokenWindows unpacked by the caller); tensors carry no tags
    corpus = corpus or "caller's tokens (no corpus label: pass corpus= or a TokenWindows)"
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
        interventions=interventions,
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

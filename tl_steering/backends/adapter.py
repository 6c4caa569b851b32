"""The one place that knows TransformerLens's model classes: :class:`ModelAdapter`, through which the rest of
tl_steering talks to a model (what it guarantees: docs/architecture.md, "Rules that keep the rooms apart")."""

import contextlib
import contextvars
import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .. import validation
from ..errors import (DeviceMismatchError, HookNotFoundError, InputError, ModelNotSupportedError, NonFiniteError,
                      ParallelBlockError, ResidualIdentityError, UserHooksWarning)
from ..metrics import next_token_loss
from . import lifecycle as _lifecycle
from . import ownership as _ownership
from .detect import _SITE_HOOK, SITES, Backend, backend_of, parameter_device, tl_version
from .hookbase import mark_owned
from .lifecycle import hooks_silenced
from .processing import WeightProcessing, warn_if_processed, warn_once, weight_processing
from .sublayers import SublayerNorms, attention_apply, ffn_apply, sublayer_norms


def check_finite(x: Tensor, layer: int | None, site: str) -> None:
    """Raise :class:`NonFiniteError` naming the layer and site when ``x`` has NaN or Inf."""
    if not validation.all_finite(x):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        where = f"layer {layer}, {site}" if layer is not None else site
        raise NonFiniteError(
            f"non-finite activation at {where}: {n_nan} NaN and {n_inf} Inf values. Check the model weights "
            "and any hooks of yours on that point; in float16 try float32 or bfloat16.")


@dataclasses.dataclass
class ModelInfo:
    """Provenance tags that tl_steering's loaders attach to a model (``model._tl_steering_info``)."""

    name: str = "unknown"
    revision: str | None = None
    processing: str = "unknown"
    prepend_bos: bool = True


class ModelAdapter:
    """Uniform access to a TransformerLens model (HookedTransformer or TransformerBridge), used as is: the adapter
    never changes weights and every hook it adds is removed before its methods return."""

    def __init__(self, model: Any):
        self.model = model
        self.backend: Backend = backend_of(model)
        self.cfg = model.cfg
        self.n_layers: int = int(self.cfg.n_layers)
        self.d_model: int = int(self.cfg.d_model)
        # HookedTransformer and bridges build hook_resid_mid only on sequential blocks (a bridge: alias of ln2.hook_in)
        self._parallel = [type(blk).__name__ == "ParallelBlockBridge" or not hasattr(blk, "hook_resid_mid")
                          for blk in model.blocks]
        self._hook_names: frozenset[str] | None = None  # model.hook_dict's names, taken once (like the layout above)

    # -- identity ----------------------------------------------------------------------------------------
    @property
    def info(self) -> ModelInfo:
        return self.info_with(self.processing)

    def info_with(self, processing: "WeightProcessing") -> ModelInfo:
        """:attr:`info` with the weight processing already read (a provenance reads it once)."""
        info = getattr(self.model, "_tl_steering_info", None)
        if isinstance(info, ModelInfo):  # the loader's name and revision; the processing as the model is now
            return dataclasses.replace(info, processing=processing.label)
        name = getattr(self.cfg, "model_name", None) or type(self.model).__name__
        return ModelInfo(name=str(name), processing=processing.label, prepend_bos=bool(
            getattr(self.cfg, "default_prepend_bos", True)))

    @property
    def processing(self) -> "WeightProcessing":
        """What TransformerLens did to the weights, read from the model (:func:`.processing.weight_processing`)."""
        return weight_processing(self.model)

    @property
    def dtype(self) -> torch.dtype:
        """Parameter dtype (read from the weights, not from cfg)."""
        for p in self.model.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.float32

    @property
    def n_ctx(self) -> int | None:
        """The model's context length (None when the config does not say)."""
        n = getattr(self.cfg, "n_ctx", None)
        return int(n) if isinstance(n, int) and n > 0 else None

    @property
    def device(self) -> torch.device:
        return parameter_device(self.model)

    # -- structure ---------------------------------------------------------------------------------------
    def is_parallel(self, layer: int) -> bool:
        """Whether block ``layer`` computes x + A(x) + Phi(x) (GPT-NeoX/Pythia, GPT-J style)."""
        return self._parallel[self.check_layer(layer)]

    @property
    def any_parallel(self) -> bool:
        return any(self._parallel)

    def check_layer(self, layer: int, name: str = "layer") -> int:
        """One valid layer index (int, not bool/float/str; negative counts from the end)."""
        return validation.as_layer(layer, self.n_layers, name)

    def layers(self, layers: Sequence[int] | int | None = None, name: str = "layers", *,
               allow_none: bool = True) -> list[int]:
        """Normalise a layer selection (None = all) into a sorted list of valid indices (strict types, see
        :func:`tl_steering.validation.as_layers`)."""
        return validation.as_layers(layers, self.n_layers, name, allow_none=allow_none)

    def ffn_input_site(self, layer: int) -> Literal["resid_mid", "resid_pre"]:
        """Where the FFN reads its input: resid_mid for sequential blocks, resid_pre for parallel ones."""
        return "resid_pre" if self.is_parallel(layer) else "resid_mid"

    def hook_name(self, layer: int, site: str, hook_dict: Mapping[str, Any] | None = None) -> str:
        """TransformerLens hook name for ``site`` of block ``layer`` (legacy names; bridges alias them); ``"ffn_input"``
        resolves per block. ``hook_dict``: a snapshot of ``model.hook_dict`` (a bridge rebuilds it on every access;
        without one, the adapter reads it once)."""
        layer = self.check_layer(layer)
        if site == "ffn_input":
            site = self.ffn_input_site(layer)
        if site not in _SITE_HOOK:
            raise InputError(f"unknown site {site!r}; choose one of {', '.join(SITES)}")
        if self.is_parallel(layer) and site in ("resid_mid", "mlp_in"):
            raise ParallelBlockError(
                f"block {layer} is a parallel attention/MLP block: it has no {site} (the MLP reads "
                "ln2(resid_pre)). Use site='ffn_input' (resolves to resid_pre here) or 'resid_pre'.")
        name = f"blocks.{layer}.{_SITE_HOOK[site]}"
        if hook_dict is None and self._hook_names is None:
            self._hook_names = frozenset(self.model.hook_dict)
        if name not in (self._hook_names if hook_dict is None else hook_dict):
            raise HookNotFoundError(
                f"hook {name!r} does not exist on this {type(self.model).__name__}"
                + (" (GPT-J/Phi-style bridges have no ln2 hooks)" if site == "ln2_normalized" else ""))
        return name

    # -- pure sublayer callables -------------------------------------------------------------------------
    def sublayer_norms(self, layer: int) -> SublayerNorms:
        """The norms around block ``layer``'s sublayers, detected from the block's modules (see
        docs/gemma.md): ``pre_attn``, ``post_attn`` (Gemma 2/3, OLMo 2), ``pre_ffn``, ``post_ffn``; None = absent."""
        return sublayer_norms(self.model.blocks[self.check_layer(layer)])

    def require_resident(self, layers: Sequence[int], what: str) -> None:
        """Refuse blocks whose weights accelerate offloaded (``meta`` device) for ``what`` (JVPs, block copies:
        docs/scale_out.md)."""
        for layer in layers:
            blk = self.model.blocks[self.check_layer(layer)]
            if any(p.device.type == "meta" for p in blk.parameters()):
                raise ModelNotSupportedError(
                    f"layer {layer}: its weights are offloaded by accelerate (meta device) and {what} needs them in "
                    "memory (Jacobian-vector products or a copy of the block). Load the model without offload "
                    "(forward-only measurements -- probe, scan, deficit, diversity, ablation, losses -- do run on it)")

    def ffn(self, layer: int) -> Callable[[Tensor], Tensor]:
        """Phi_l(x) = post_ffn(MLP(pre_ffn(x))) as a pure function of a residual ``[..., d_model]`` (positionwise;
        Phi(resid_mid) == hook_mlp_out on every supported block: docs/gemma.md), in the model dtype. No hook fires
        inside it, so a user's steering hooks cannot contaminate JVPs or Jacobians."""
        blk = self.model.blocks[self.check_layer(layer)]
        norms = sublayer_norms(blk)
        model = self.model

        def phi(x: Tensor) -> Tensor:
            shape = x.shape
            x3 = x if x.dim() == 3 else x.reshape(1, -1, shape[-1])
            with _ownership.claim(model, "ModelAdapter.ffn", record_hooks=False), hooks_silenced(blk):
                out = ffn_apply(blk, norms, x3)
            return out.reshape(shape)

        return phi

    def attention(self, layer: int) -> Callable[[Tensor], Tensor]:
        """A_l(X) = post_attn(attn(pre_attn(X))) as a function of the full residual ``[batch, pos, d_model]``: causal,
        rotary embeddings for positions 0..pos-1 and the layer's sliding window (docs/gemma.md). No hook fires."""
        layer = self.check_layer(layer)
        blk = self.model.blocks[layer]
        model = self.model
        norms = sublayer_norms(blk)

        def attn(x: Tensor) -> Tensor:
            if x.dim() != 3:
                raise InputError(f"attention expects [batch, pos, d_model], got shape {tuple(x.shape)}")
            with _ownership.claim(model, "ModelAdapter.attention", record_hooks=False), hooks_silenced(model):
                return attention_apply(model, blk, norms, self.backend, x)

        return attn

    def has_hooks(self) -> bool:
        """Whether any hook point of the model holds a forward or backward hook now (a user's steering hook,
        say): paths that run sublayers directly (:meth:`run_blocks`) would bypass it."""
        return any(getattr(hp, a) for hp in _lifecycle.hook_points(self.model) for a in _lifecycle._SILENCED)

    def run_blocks(self, x: Float[Tensor, "batch pos d_model"], start: int, parallel: Sequence[int] = (),
                   write: Callable[[int, Tensor, Tensor, Tensor], Tensor] | None = None
                   ) -> Float[Tensor, "batch pos vocab"]:
        """The logits from ``x``, the residual entering block ``start`` ``[batch, pos, d_model]``: blocks
        ``start..L-1`` through the adapter's sublayers, the final norm, the unembedding (docs/defect.md, "Prefix
        sharing"). No hook fires. A block in ``parallel`` (or parallel already) computes x + A(x) + Phi(x), the
        surrogate of :func:`tl_steering.hooks.parallel_blocks`; ``write(layer, sequential_write, parallel_write,
        attn_write)`` replaces a chosen block's FFN write as in :func:`tl_steering.hooks.parallel_hooks` (a ``write``
        whose ``reads_sequential`` is False gets Phi(x) as its sequential write: that FFN is not run)."""
        start = self.check_layer(start, "start")
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise InputError(f"run_blocks expects the residual [batch, pos, d_model={self.d_model}], got shape "
                             f"{tuple(x.shape)}")
        chosen = set(int(v) for v in parallel)
        with _ownership.claim(self.model, "ModelAdapter.run_blocks", record_hooks=False), \
                hooks_silenced(self.model):
            for lay in range(start, self.n_layers):
                blk = self.model.blocks[lay]
                norms = sublayer_norms(blk)
                a = attention_apply(self.model, blk, norms, self.backend, x)
                if self.is_parallel(lay):
                    x = x + a + ffn_apply(blk, norms, x)
                elif lay in chosen:
                    par = ffn_apply(blk, norms, x)
                    if write is not None:  # the sequential write only for a write that reads it
                        seq = ffn_apply(blk, norms, x + a) if getattr(write, "reads_sequential", True) else par
                        par = write(lay, seq, par, a)
                    x = x + a + par
                else:
                    y = x + a
                    x = y + ffn_apply(blk, norms, y)
            logits = self.model.unembed(self.model.ln_final(x))
        cap = float(getattr(self.cfg, "output_logits_soft_cap", 0.0) or 0.0)
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        return logits

    # -- running -----------------------------------------------------------------------------------------
    def run_with_hooks(self, tokens: Tensor, fwd_hooks: list[tuple[Any, Callable]] = (),
                       return_type: str | None = "logits", grad: bool = False, **kwargs: Any) -> Any:
        """Forward with hooks, every hook removed afterwards, also on error or interrupt (docs/hooks.md);
        ``grad=True`` keeps autograd on (gradients w.r.t. hooked activations)."""
        if not fwd_hooks and return_type == "logits" and not grad and not kwargs and _shared(self.model):
            return self.run_with_cache(tokens, [])[0]
        if getattr(self.cfg, "attn_only", False) and any("mlp" in str(name) for name, _ in fwd_hooks):
            raise ModelNotSupportedError("this model has no MLP blocks (cfg.attn_only), and this call reads or changes "
                                         "their FFN output: use a model with MLP blocks")
        return _lifecycle.run_with_hooks(self.model, tokens, fwd_hooks, return_type=return_type, grad=grad, **kwargs)

    def loss_per_token(self, tokens: Tensor, fwd_hooks: list[tuple[Any, Callable]] = ()
                       ) -> Float[Tensor, "batch pos_minus_1"]:
        """Next-token cross-entropy per predicted position (float64), with optional hooks."""
        logits = self.run_with_hooks(tokens, fwd_hooks, return_type="logits")
        return next_token_loss(logits, tokens)

    def run_with_cache(self, tokens: Tensor, names: Sequence[str], fwd_hooks: list[tuple[Any, Callable]] = ()
                       ) -> tuple[Tensor, dict[str, Tensor]]:
        """Forward, collecting the activations at ``names`` (detached) with our own light hooks;
        :class:`NonFiniteError` naming the layer and site when one has NaN/Inf. Inside :func:`shared_clean_forwards`
        a hook-free forward of a token batch seen before is not run again."""
        memo = _shared(self.model)
        if memo is not None and not fwd_hooks:
            return memo.forward(self, tokens, list(names))
        store: dict[str, Tensor] = {}

        def saver(name: str) -> Callable:
            def fn(act: Tensor, hook: Any) -> None:
                store[name] = act.detach()
            return mark_owned(fn)  # ours: a probe around this call does not count it as the user's

        hooks = list(fwd_hooks) + [(n, saver(n)) for n in names]
        logits = self.run_with_hooks(tokens, hooks, return_type="logits")
        missing = [n for n in names if n not in store]
        if missing:
            raise HookNotFoundError(f"hook(s) {missing} exist but never fired on this model")
        for n in names:  # blocks.3.hook_x -> layer 3, site hook_x
            m = re.fullmatch(r"blocks\.(\d+)\.(.+)", n)
            check_finite(store[n], int(m[1]) if m else None, m[2] if m else n)
        return logits, store

    # -- checks ------------------------------------------------------------------------------------------
    def validate_tokens(self, tokens: Any, min_len: int = 2) -> Int[Tensor, "batch pos"]:
        """Check a token batch and move nothing silently: wrong device is an error, not a copy."""
        if not isinstance(tokens, Tensor):
            raise InputError(f"tokens must be a torch.Tensor of token ids, got {type(tokens).__name__}; "
                             "use model.to_tokens(text) or tl_steering.text_tokens(model)")
        if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise InputError(f"tokens must be integer ids (torch.long), got dtype {tokens.dtype}")
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2:
            raise InputError(f"tokens must have shape [batch, pos], got {tuple(tokens.shape)}")
        if tokens.shape[0] == 0:
            raise InputError("empty batch: tokens has 0 sequences")
        if tokens.shape[1] < min_len:
            raise InputError(f"sequences of length {tokens.shape[1]} are too short: at least {min_len} positions are "
                             "needed (position 0 is excluded from statistics and a next-token loss needs two)")
        validation.check_length(int(tokens.shape[1]), self.n_ctx)
        validation.check_not_meta(tokens)
        if tokens.device != self.device:
            raise DeviceMismatchError(f"tokens are on {tokens.device} but the model is on {self.device}; "
                                      f"move them with tokens.to('{self.device}')")
        vocab = int(self.cfg.d_vocab)
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= vocab:
            raise InputError(f"token ids must lie in [0, {vocab}); got range [{lo}, {hi}]")
        return tokens.long()

    def identity_tolerance(self) -> float:
        """Relative tolerance for residual identities: dtype-aware."""
        return {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 5e-3}.get(
            self.dtype, 1e-5)

    def check_residual_identity(self, cache: dict[str, Tensor], layers: Sequence[int] | None = None,
                                rtol: float | None = None) -> dict[int, float]:
        """Check resid_pre + attn_out (+ mlp_out) against resid_mid / resid_post for each layer of ``cache``: the
        worst relative error per layer (error / max |residual|); :class:`ResidualIdentityError` naming the layer
        when one exceeds ``rtol``."""
        rtol = self.identity_tolerance() if rtol is None else rtol
        out: dict[int, float] = {}
        for layer in self.layers(layers):
            g = lambda s: cache[self.hook_name(layer, s)].to(torch.float64)  # noqa: E731
            pre, attn, mlp, post = g("resid_pre"), g("attn_out"), g("mlp_out"), g("resid_post")
            scale = max(float(post.abs().max()), float(pre.abs().max()), 1e-30)
            if self.is_parallel(layer):
                errs = {"resid_pre + attn_out + mlp_out = resid_post": float((pre + attn + mlp - post).abs().max())}
            else:
                mid = g("resid_mid")
                errs = {"resid_pre + attn_out = resid_mid": float((pre + attn - mid).abs().max()),
                        "resid_mid + mlp_out = resid_post": float((mid + mlp - post).abs().max())}
            worst = max(errs.values()) / scale
            out[layer] = worst
            if not worst <= rtol:
                which = max(errs, key=errs.get)
                raise ResidualIdentityError(
                    f"layer {layer}: {which} fails (relative error {worst:.3g} > {rtol:.1g}). The model's "
                    "hook_attn_out / hook_mlp_out do not decompose the residual stream (a known class of "
                    "TransformerBridge bugs, or a hook of yours rewrote an activation); tl_steering's "
                    "decompositions would be wrong on it.")
        return out

    def identity_names(self, layers: Sequence[int] | None = None) -> list[str]:
        """The hook names :meth:`check_residual_identity` reads."""
        sites = ("resid_pre", "attn_out", "mlp_out", "resid_post")
        return [self.hook_name(layer, s) for layer in self.layers(layers)
                for s in sites + (() if self.is_parallel(layer) else ("resid_mid",))]

    # -- provenance --------------------------------------------------------------------------------------
    def provenance(self, tokens: Tensor | None = None, corpus: str | None = None, seed: int | None = None,
                   **extra: Any):
        """The :class:`~tl_steering.results.Provenance` of a result measured on this model with ``tokens``: model,
        revision, TL version, backend, weight processing (docs/loading.md, "Weight processing"), the user's hook
        points during the call (docs/hooks.md, "The user's own hooks"; ``user_hooks=`` / ``interventions=`` in
        ``extra``: those a probe saw instead), corpus, seed, dtype, device, world size and ``extra`` options; warns
        once per model on a processed residual stream and once per set of user hooks."""
        from ..results import Provenance

        proc = self.processing
        info = self.info_with(proc)
        warn_if_processed(self.model, proc)
        # a probe passes the user's hook points and the hook factories' hooks it saw during its own forwards: those
        # are the hooks its numbers were measured under (not the ones on the model when the result is read)
        seen = extra.pop("user_hooks", None)
        seen_interventions = extra.pop("interventions", None)
        user_hooks = sorted(_ownership.active_user_hooks(self.model) if seen is None else set(seen))
        interventions = sorted(_ownership.active_interventions(self.model) if seen_interventions is None
                               else set(seen_interventions))
        if user_hooks:
            shown = ", ".join(user_hooks[:3]) + (", …" if len(user_hooks) > 3 else "")
            warn_once(self.model, ("user_hooks", tuple(user_hooks)),
                      f"{len(user_hooks)} hook point(s) carry hooks not made by tl_steering ({shown}): the result "
                      "measures the model as they change it (recorded in provenance.user_hooks). Silence: "
                      "warnings.filterwarnings('ignore', category=tl_steering.errors.UserHooksWarning).",
                      stacklevel=3, category=UserHooksWarning)
        # passed explicitly (corpus=, or a data.TokenWindows unpacked by the caller); tensors carry no tags
        corpus = corpus or "caller's tokens (no corpus label: pass corpus= or a TokenWindows)"
        world_size = (torch.distributed.get_world_size()
                      if torch.distributed.is_available() and torch.distributed.is_initialized() else 1)
        n_seq, n_tok = (int(tokens.shape[0]), int(tokens.numel())) if tokens is not None else (0, 0)
        return Provenance(
            model=info.name, model_revision=info.revision, tl_version=tl_version(), backend=self.backend,
            processing=proc.label, processing_steps=list(proc.steps), user_hooks=user_hooks,
            interventions=interventions, corpus=str(corpus), n_sequences=n_seq, n_tokens=n_tok, seed=seed,
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device), world_size=world_size,
            extra=extra)


class _CleanForwards:
    """The hook-free forwards of one model inside :func:`shared_clean_forwards`: per token batch, its logits and
    its activations at :meth:`ModelAdapter.identity_names` (and any other name asked for), up to ``max_bytes``; and
    the per-window values of :func:`shared_rows`, per tag."""

    def __init__(self, model: Any, max_bytes: int):
        self.model, self.left = model, max_bytes
        self.runs: dict[tuple, dict[str, Tensor]] = {}  # tokens -> logits ("logits") and activations
        self.sizes: dict[tuple, int] = {}  # bytes each kept run counts against max_bytes
        self.kept: dict[Any, dict[tuple, dict[str, Tensor]]] = {}  # shared_rows: tag -> tokens -> values

    def forward(self, ad: ModelAdapter, tokens: Tensor, names: list[str]) -> tuple[Tensor, dict]:
        key = _token_key(tokens)
        got = _rows_of(self.runs, key, names + ["logits"])
        if got is not None:
            return got.pop("logits"), got
        wanted = list(dict.fromkeys(names + ad.identity_names()))
        size = tokens.numel() * (int(ad.cfg.d_vocab) + len(wanted) * ad.d_model) * torch.finfo(ad.dtype).bits // 8
        freed = self.sizes.get(key, 0)  # a run with fewer names is replaced: its bytes come back
        token = _SHARED.set(None)
        try:
            if size > self.left + freed:  # too big to keep: an ordinary forward
                return ad.run_with_cache(tokens, names)
            logits, cache = ad.run_with_cache(tokens, wanted)
            self.runs[key] = {"logits": logits, **cache}
            self.left += freed - size
            self.sizes[key] = size
        finally:
            _SHARED.reset(token)
        return logits.clone(), {n: cache[n].clone() for n in names}  # a caller may write into what it gets


def _token_key(tokens: Tensor) -> tuple:
    return tuple(tokens.shape), str(tokens.device), tokens.cpu().numpy().tobytes()


def _rows_of(runs: dict[tuple, dict[str, Tensor]], key: tuple, names: list[str]) -> dict[str, Tensor] | None:
    """Copies of ``names`` at the rows of a kept run (values whose dim 0 is its windows) that hold the windows of
    ``key`` (shape, device, bytes), in its order (a window's values do not depend on the other windows of its
    batch), else None."""
    want_shape, want_device, want = key
    n, row = want_shape[0], len(want) // max(1, want_shape[0])  # windows, bytes per window
    for (shape, device, raw), run in runs.items():
        if shape[1:] == want_shape[1:] and device == want_device and len(raw) == shape[0] * row \
                and set(names) <= run.keys():
            at = {raw[i * row:(i + 1) * row]: i for i in range(shape[0])}
            idx = [at.get(want[i * row:(i + 1) * row], -1) for i in range(n)]
            if min(idx, default=-1) >= 0:
                return {m: run[m][torch.tensor(idx, device=run[m].device)] for m in names}  # indexing copies
    return None


def shared_rows(model: Any, tag: Any, tokens: Tensor, names: list[str], compute: Callable[[], dict[str, Tensor]],
                reuse: bool = True) -> dict[str, Tensor]:
    """``compute()``: small per-window values (dim 0: the windows of ``tokens``). Inside :func:`shared_clean_forwards`
    they are kept under ``tag`` (what else they depend on), and with ``reuse`` a call whose windows a kept call
    held, with every one of ``names``, gets those rows instead (docs/suite.md, "Stages")."""
    got = kept_rows(model, tag, tokens, names) if reuse else None
    return dict(got) if got is not None else keep_rows(model, tag, tokens, compute())


def kept_rows(model: Any, tag: Any, tokens: Tensor, names: list[str]) -> dict[str, Tensor] | None:
    """The rows of :func:`shared_rows`' kept values of ``tag`` that hold ``tokens``' windows, else None."""
    memo = _shared(model)
    return None if memo is None else _rows_of(memo.kept.get(tag, {}), _token_key(tokens), names)


def keep_rows(model: Any, tag: Any, tokens: Tensor, values: dict[str, Tensor]) -> dict[str, Tensor]:
    """Keep ``values`` (per window of ``tokens``) under ``tag`` inside :func:`shared_clean_forwards`; a copy of the
    dict (the same tensors)."""
    if (memo := _shared(model)) is not None:
        memo.kept.setdefault(tag, {})[_token_key(tokens)] = values
    return dict(values)


_SHARED: contextvars.ContextVar[_CleanForwards | None] = contextvars.ContextVar("tl_steering_clean", default=None)


def _shared(model: Any) -> _CleanForwards | None:
    memo = _SHARED.get()
    return memo if memo is not None and memo.model is model else None


@contextlib.contextmanager
def shared_clean_forwards(model: Any, max_bytes: int = 1 << 30) -> Any:
    """Inside the block, the hook-free forwards of ``model`` run once per token batch: a later one returns a copy of
    the first one's logits and activations (the same numbers; docs/suite.md, "Stages")."""
    token = _SHARED.set(_CleanForwards(model, max_bytes))
    try:
        yield
    finally:
        _SHARED.reset(token)


def adapt(model: Any) -> ModelAdapter:
    """The :class:`ModelAdapter` for ``model`` (validates that it is a TransformerLens model)."""
    if isinstance(model, ModelAdapter):
        return model
    return ModelAdapter(model)


__all__ = ["ModelAdapter", "ModelInfo", "adapt", "check_finite", "keep_rows", "kept_rows", "shared_clean_forwards",
           "shared_rows"]

"""An exact float64 copy of one block's sublayers for the critical-point fields (:class:`Float64Block`), run inside
:class:`float64_compute`. See docs/critical_points.md, "Exact float64 copy"."""

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..errors import InputError
from .adapter import ModelAdapter
from .copying import deepcopy_module
from .lifecycle import _SILENCED, hook_points, hooks_silenced
from .interrupts import deferred_signals
from .sublayers import _apply, attention_apply, ffn_apply, sublayer_norms, unwrap
from . import autodiff

_LOW = (torch.float32, torch.float16, torch.bfloat16)
_CAST_METHODS = {torch.Tensor.float: torch.float32, torch.Tensor.half: torch.float16,
                 torch.Tensor.bfloat16: torch.bfloat16}
_SOFTMAX = {torch.nn.functional.softmax, torch.nn.functional.log_softmax, torch.softmax, torch.log_softmax,
            torch.Tensor.softmax, torch.Tensor.log_softmax}


def _is64(x: Any) -> bool:
    return isinstance(x, Tensor) and x.dtype == torch.float64


class _KeepFloat64(TorchFunctionMode):
    """Keeps float64 tensors float64 where code requests float32/16 (:class:`float64_compute`)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _CAST_METHODS and args and _is64(args[0]):
            return args[0]
        if func is torch.Tensor.to and args and _is64(args[0]):
            if kwargs.get("dtype") in _LOW:
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if (a in _LOW) else a for a in args)
            if len(args) > 1 and isinstance(args[1], Tensor) and args[1].dtype in _LOW:  # .to(other_tensor)
                args = (args[0], torch.float64, *args[2:])
        elif func is torch.Tensor.type and args and _is64(args[0]):
            target = args[1] if len(args) > 1 else kwargs.get("dtype")
            if target in _LOW:
                return args[0]
        elif func is torch.Tensor.type_as and len(args) > 1 and _is64(args[0]) and args[1].dtype in _LOW:
            return args[0]
        elif func in _SOFTMAX and args and _is64(args[0]):
            if kwargs.get("dtype") in _LOW:
                kwargs["dtype"] = torch.float64
            args = tuple(torch.float64 if a in _LOW else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_compute() -> Any:
    """Context manager: inside it, float64 tensors are not downcast by ``.to(float32)``, ``.float()``, ``.half()``,
    ``.type(float32)``, ``.type_as(float32 tensor)`` or ``softmax(..., dtype=float32)``; thread-local; signals held
    (docs/hooks.md, "Interrupts")."""
    with deferred_signals(), _KeepFloat64():
        yield


def _private_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A float64 deep copy of ``module`` that carries no hook (the user's module is unchanged)."""
    with hooks_silenced(module):
        cp = deepcopy_module(module)
    for hp in hook_points(cp):  # the copy is private: empty its hook dicts (cheaper than silencing per call)
        for attr in _SILENCED:
            getattr(hp, attr).clear()
    cp.to(torch.float64)
    cp.requires_grad_(False)
    cfg = getattr(cp, "cfg", None)
    if hasattr(cfg, "dtype"):
        with contextlib.suppress(AttributeError, TypeError):  # a frozen config
            cfg.dtype = torch.float64  # HookedTransformer norms cast their output to cfg.dtype (copy's own cfg)
    return cp


class Float64Block:
    """A private float64 copy of block ``layer`` (``self.blk``, its sublayer ``norms``) with the pure callables of
    the adapter's :meth:`ModelAdapter.ffn` / :meth:`ModelAdapter.attention`, in float64 and differentiable by
    ``torch.func``."""

    def __init__(self, ad: ModelAdapter, layer: int) -> None:
        self.ad = ad
        self.layer = ad.check_layer(layer)
        self.backend = ad.backend
        self.blk = _private_copy(ad.model.blocks[self.layer])
        self.norms = sublayer_norms(self.blk)
        self.d_model = ad.d_model
        self._traced: Any = None  # None: not built yet; False: tracing failed its check (use ffn)
        self._parts: Any = None  # the same for the MLP's matrices of ffn_jacobian
        self._cast: dict[torch.dtype, tuple] = {}  # those matrices in the dtypes asked of ffn_jacobian

    @property
    def has_post_ffn_norm(self) -> bool:
        return self.norms.post_ffn is not None

    def ffn(self, x: Tensor) -> Tensor:
        """Phi(x) for ``[..., d]`` input (cast to float64)."""
        if x.shape[-1] != self.d_model:
            raise InputError(f"ffn expects [..., {self.d_model}], got shape {tuple(x.shape)}")
        shape = x.shape
        x3 = x.to(torch.float64).reshape(1, -1, shape[-1])
        with float64_compute():
            out = ffn_apply(self.blk, self.norms, x3)
        return out.reshape(shape)

    def ffn_no_grad(self, x: Tensor) -> Tensor:
        """Phi(x) like :meth:`ffn`, without autograd, through a ``torch.jit.trace`` recording checked against
        :meth:`ffn` (docs/critical_points.md); not differentiable by torch.func: use :meth:`ffn` for Jacobians."""
        if x.shape[-1] != self.d_model:
            raise InputError(f"ffn expects [..., {self.d_model}], got shape {tuple(x.shape)}")
        if self._traced is None:
            self._traced = self._trace_ffn(x.device)
        if self._traced is False:
            with torch.no_grad():
                return self.ffn(x)
        shape = x.shape
        with torch.no_grad():
            return self._traced(x.to(torch.float64).reshape(1, -1, shape[-1])).reshape(shape)

    def _trace_ffn(self, device: torch.device) -> Any:
        import warnings

        def run(x3: Tensor) -> Tensor:
            with float64_compute():
                return ffn_apply(self.blk, self.norms, x3)

        gen = torch.Generator(device="cpu").manual_seed(0)
        probe = [torch.randn(1, n, self.d_model, generator=gen, dtype=torch.float64).to(device) for n in (5, 3, 9)]
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(run, (probe[0],), check_trace=False)
                for x3 in probe[1:]:
                    want = run(x3)
                    got = traced(x3)
                    if got.shape != want.shape or float((got - want).abs().max()) > 1e-12 * float(want.abs().max()):
                        return False
        except Exception:  # noqa: BLE001 - a block the tracer cannot record: the eager path stays correct
            return False
        return traced

    def ffn_jacobian(self, x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor | None:
        """DPhi at each row of ``x`` (``[n, d] -> [n, d, d]`` in ``dtype``) from the MLP's own matrices: W_down
        (diag(act'(g) v) W_gate + diag(act(g)) W_up) composed with the norms' Jacobians, an RMS pre-norm's weight
        folded into W_gate and W_up, activations in float64 (docs/critical_points.md, "Structured Jacobian"); None
        where the MLP has no gated or plain form this knows, or where that form fails its check against a JVP."""
        if self._parts is None:
            self._parts = _mlp_parts(self.blk.mlp)
            if self._parts:
                rms = _rms_form(self.norms.pre_ffn, x.new_ones(2, self.d_model).cumsum(-1))
                if rms is not None:
                    wg, bg, wu, bu, wd, act = self._parts
                    self._parts = (wg * rms[0], bg, None if wu is None else wu * rms[0], bu, wd, act, rms[1])
            self._parts = self._parts if self._parts and self._jac_agrees(x.device) else False
        if self._parts is False:
            return None
        wg, bg, wu, bu, wd, act, *eps = self._parts
        x = x.to(torch.float64)
        with torch.no_grad(), float64_compute():
            if eps:  # RMS pre-norm: n = w x / r, Dn = diag(w) (I - x xᵀ / (d r²)) / r
                r2 = (x * x).mean(-1, keepdim=True) + eps[0]
                n, jac_pre = x / r2.sqrt(), None
            else:
                n, jac_pre = self._norm_jac(self.norms.pre_ffn, x)
            g = torch.nn.functional.linear(n, wg, bg)
            a, da = autodiff.jvp(act, (g,), (torch.ones_like(g),))  # act elementwise: act(g), act'(g)
            c = da if wu is None else da * torch.nn.functional.linear(n, wu, bu)
            post = None if self.norms.post_ffn is None else self._norm_jac(self.norms.post_ffn, _apply(
                self.blk.mlp, _apply(self.norms.pre_ffn, x[None]))[0])[1]
        wg, wu, wd = self._cast.get(dtype) or self._cast.setdefault(dtype, tuple(
            None if w is None else w.to(dtype) for w in (wg, wu, wd)))  # outside float64_compute: casts happen
        with torch.no_grad():
            a, c = a.to(dtype), c.to(dtype)
            jac, buf = wg.new_empty(x.shape[0], self.d_model, self.d_model), torch.empty_like(wg)
            for k in range(x.shape[0]):  # one row at a time: the [d_mlp, d] product stays in cache
                torch.mul(wg, c[k, :, None], out=buf)
                if wu is not None:
                    buf.addcmul_(wu, a[k, :, None])
                torch.matmul(wd, buf, out=jac[k])
            if eps:  # in place: no [n, d, d] temporary
                x, r2 = x.to(dtype), r2.to(dtype)
                jac.baddbmm_(jac @ x[..., None], (x / (self.d_model * r2))[:, None, :], alpha=-1)
                jac.div_(r2.sqrt()[..., None])
            elif jac_pre is not None:
                jac = jac @ jac_pre.to(dtype)
            return jac if post is None else post.to(dtype) @ jac

    @staticmethod
    def _norm_jac(norm: torch.nn.Module | None, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """(norm(x), its Jacobian per row) for ``[n, d]`` rows; (x, None) for an absent norm."""
        if norm is None:
            return x, None
        one = lambda z: _apply(norm, z[None, None])[0, 0]  # noqa: E731
        return _apply(norm, x[None])[0], autodiff.vmap(autodiff.jacrev(one))(x)

    def _jac_agrees(self, device: torch.device) -> bool:
        gen = torch.Generator(device="cpu").manual_seed(0)
        x, t = (torch.randn(2, self.d_model, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
        try:
            got = (self.ffn_jacobian(x) @ t[..., None])[..., 0]
            want = torch.autograd.functional.jvp(self.ffn, x, t)[1]
        except Exception:  # noqa: BLE001 - a form this does not know: autograd stays correct
            return False
        return bool(float((got - want).abs().max()) <= 1e-10 * float(want.abs().max()))

    def attention(self, x: Tensor) -> Tensor:
        """A(X) for ``[batch, pos, d]`` input (cast to float64)."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise InputError(f"attention expects [batch, pos, {self.d_model}], got shape {tuple(x.shape)}")
        model = self.ad.model
        rotary = getattr(model, "rotary_emb", None)
        silence = hooks_silenced(rotary) if isinstance(rotary, torch.nn.Module) else contextlib.nullcontext()
        with silence, float64_compute():
            return attention_apply(model, self.blk, self.norms, self.backend, x.to(torch.float64))


def _mlp_parts(mlp: torch.nn.Module) -> tuple | None:
    """(W_gate, b_gate, W_up, b_up, W_down, act) of a gated MLP, act(x W_gate + b_gate) * (x W_up + b_up) ->
    W_down (W_up None for a plain MLP act(x W + b)), as [out, in] matrices; None for any other form."""
    hf = unwrap(mlp)
    g, u, d = (unwrap(getattr(hf, k, None)) for k in ("gate_proj", "up_proj", "down_proj"))
    if all(isinstance(m, torch.nn.Linear) for m in (g, u, d)):
        return g.weight, g.bias, u.weight, u.bias, d.weight, hf.act_fn
    w_in, w_out = (mlp._parameters.get(k) for k in ("W_in", "W_out"))  # HookedTransformer's MLP / GatedMLP
    if w_in is None or w_out is None or not callable(getattr(mlp, "act_fn", None)):
        return None
    w_gate = mlp._parameters.get("W_gate")
    if w_gate is None:
        return w_in.T, mlp.b_in, None, None, w_out.T, mlp.act_fn
    return w_gate.T, None, w_in.T, None, w_out.T, mlp.act_fn


def _rms_form(norm: torch.nn.Module | None, x: Tensor) -> tuple[Tensor, float] | None:
    """(w, eps) when ``norm`` computes w x / sqrt(mean(x²) + eps) at the probe rows ``x`` (its weight, or 1 + it as in
    Gemma), else None."""
    hf = unwrap(norm)
    eps = getattr(hf, "variance_epsilon", getattr(hf, "eps", None))
    weight = next((p for p in hf.parameters() if p.shape == x.shape[-1:]), None) if norm is not None else None
    if weight is None or not isinstance(eps, float):
        return None
    with torch.no_grad(), float64_compute():
        y = _apply(norm, x[None].to(weight))[0]
        for w in (weight, 1 + weight):
            if torch.allclose(y, w * x / ((x * x).mean(-1, keepdim=True) + eps).sqrt(), rtol=1e-12, atol=0):
                return w, eps
    return None


__all__ = ["Float64Block", "float64_compute"]

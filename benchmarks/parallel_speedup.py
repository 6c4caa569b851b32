"""Measured speedup of the parallel executor vs the paper-style estimate (docs/parallel.md), in ONE process.

    python benchmarks/parallel_speedup.py [--model smollm2-135m] [--backend hooked|bridge] [--device cpu|cuda]
                                          [--strategy best|C|greedy|...] [--repeats N] [--json out.json]

The plan: ``tl_steering.plan_parallel(model, calibration, k=max(ks), strategy=--strategy, held_out=held,
k_values=ks)`` (calibration: 8 pydoc windows x 128, seed 0; held-out: 8 windows, seed 1); for every k of
0, L/4, L/2 the chosen strategy's k-set. For each shape batch x seq = 1x1 decode step (a frozen 127-token KV
cache: TL's on HookedTransformer, Hugging Face's DynamicCache on the bridge, through
``tl_steering.backends.decode_step``; the bridge row also prints the cache-less cost, its full 128-token forward),
1x128 and 8x128, THREE models are timed round-robin after warm-up:

* ``TL``: the user's model (TransformerLens, every block sequential, hook points on the path);
* ``seq``: the executor's SEQUENTIAL control (``lean_sequential_copy``): the chosen blocks stay sequential
  but run on the executor's lean kernels (folded norms, SDPA, addmm): same kernels, no TL hook overhead;
* ``par``: the executor's parallel model (``parallelize``).

Two speedups are printed, each labelled: ``vs TL`` = t_TL / t_par (implementation gain AND parallel
structure) and ``vs seq`` = t_seq / t_par (the parallel structure alone, what the paper's estimate is
about). Beside them: tokens/s, the paper-style estimate T_seq / T_par from per-submodule median times
(adapter.attention / adapter.ffn; a parallel layer costs max(t_attn, t_ffn)) and the held-out loss change.
k = 0 is an A/A control (deep copies): its "speedup" shows the timing noise.
"""

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tl_steering as ts  # noqa: E402
from tl_steering.backends import (adapt, cache_routing, decode_step, freeze_kv_cache, hooked_available,  # noqa: E402
                                  hooks_silenced, kv_cache)
from tl_steering.backends.executor import parallel_states  # noqa: E402
from tl_steering.backends.fused import _ParallelState  # noqa: E402
from tl_steering.metrics import next_token_loss  # noqa: E402
from tl_steering.parallel.apply import parallelize  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timer(fn, device: str) -> float:
    """Seconds for one call of fn (CUDA events on GPU)."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rr_medians(fns, device: str, repeats: int, warmup: int = 3) -> list[float]:
    """Median seconds of each function, timed round-robin (the order rotates every repeat)."""
    for _ in range(warmup):
        for f in fns:
            f()
    sync(device)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for j in range(len(fns)):
            i = (j + r) % len(fns)
            times[i].append(timer(fns[i], device))
    return [statistics.median(t) for t in times]


def median_time(fn, device: str, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(timer(fn, device) for _ in range(repeats))


# ----------------------------------------------------------------------------------------------------------
# the executor's SEQUENTIAL control


def _lean_weights(fw) -> dict:
    """Contiguous per-branch slices of a block's folded weights (norm affines folded per branch)."""
    n, nq = fw.n_heads * fw.d_head + 2 * fw.n_kv_heads * fw.d_head, fw.n_heads * fw.d_head
    b_o, b_down = fw.branch_biases
    cv = lambda t: None if t is None else t.to(fw.w_in.device, fw.w_in.dtype)  # noqa: E731
    return dict(w_a=fw.w_in[:, :n].contiguous(), b_a=None if fw.b_in is None else fw.b_in[:n].contiguous(),
                w_m=fw.w_in[:, n:].contiguous(), b_m=None if fw.b_in is None else fw.b_in[n:].contiguous(),
                w_o=fw.w_out[:nq].contiguous(), w_d=fw.w_out[nq:].contiguous(), b_o=cv(b_o), b_d=cv(b_down))


class _LeanSequential(_ParallelState):
    """A block state whose step runs x + A(x), then + Phi(x + A(x)), on the fused block's kernels: sequential."""

    def step(self, x, core):
        fw = self.fused
        w = self.__dict__.get("_lean_w")
        if w is None or w["w_a"].device != fw.w_in.device:
            w = self.__dict__["_lean_w"] = _lean_weights(fw)
        b, s, d = x.shape
        lin = lambda t, wt, bias: torch.addmm(bias, t, wt) if bias is not None else t @ wt  # noqa: E731
        ya = lin(fw.normalize(x).reshape(b * s, d), w["w_a"], w["b_a"])
        nq, nkv = fw.n_heads * fw.d_head, fw.n_kv_heads * fw.d_head
        q, k, v = ya.split([nq, nkv, nkv], dim=-1)
        q, k = fw.qk_norm(q.view(b, s, fw.n_heads, fw.d_head), k.view(b, s, fw.n_kv_heads, fw.d_head))
        z = core(q, k, v.view(b, s, fw.n_kv_heads, fw.d_head))
        if fw.sandwich:
            a = z.reshape(b * s, -1) @ w["w_o"]
            a = a if w["b_o"] is None else a + w["b_o"]
            x1 = x.reshape(b * s, d) + (a if fw.post_attn_g is None else fw._rms(a, fw.post_attn_g, fw.post_eps))
        else:
            x1 = torch.addmm(x.reshape(b * s, d), z.reshape(b * s, -1), w["w_o"])
            if w["b_o"] is not None:
                x1 = x1 + w["b_o"]
        ym = lin(fw.normalize(x1.view(b, s, d)).reshape(b * s, d), w["w_m"], w["b_m"])
        parts = ym.split([fw.d_mlp] * (2 if fw.gated else 1), dim=-1)
        h = fw.mlp_hidden(parts[0] if fw.gated else None, parts[-1])
        if fw.sandwich:
            m = h @ w["w_d"]
            m = m if w["b_d"] is None else m + w["b_d"]
            return (x1 + (m if fw.post_ffn_g is None else fw._rms(m, fw.post_ffn_g, fw.post_eps))).view(b, s, d)
        out = torch.addmm(x1, h, w["w_d"])
        if w["b_d"] is not None:
            out = out + w["b_d"]
        return out.view(b, s, d)


def lean_sequential_copy(model, layers):
    """Benchmark CONTROL, not a parallel model: a copy whose chosen blocks stay SEQUENTIAL but run on the same
    lean kernels as the fused parallel blocks (folded norms, SDPA, addmm). Comparing it with the original
    isolates the implementation gain; comparing the parallel model with it isolates the parallel structure's."""
    new = parallelize(model, layers, verify=False)
    for st in parallel_states(new):
        st.__class__ = _LeanSequential
    return new


# ----------------------------------------------------------------------------------------------------------
# layer plan


def layer_plans(model, calib, held, ks: list[int], strategy: str) -> tuple[dict[int, list[int]], dict]:
    """Per k, the layers of the chosen strategy's plan (chosen on calib; held-out dCE reported)."""
    plan = ts.plan_parallel(model, calib, max(ks), strategy=strategy, held_out=held, k_values=ks, batch_size=4,
                            refit="none")  # the executor below runs the layers uncorrected
    info = {"strategy": plan.strategy, "requested": strategy, "held_out_delta_ce": plan.held_out_delta_ce,
            "cost": plan.cost, "total_cost": plan.total_cost}
    return {k: plan.plan_of(plan.strategy, k) for k in ks}, info


# ----------------------------------------------------------------------------------------------------------
# submodule times and the paper-style estimate


def submodule_times(model, shape: tuple[int, int], device: str, repeats: int) -> tuple[list[float], list[float]]:
    """Median t_attn,l and t_ffn,l (seconds) at this (batch, seq), via adapter.attention / adapter.ffn, minus
    the cost of the adapter's hook-silencing context (measured separately: it walks the model's hook points)."""
    ad = adapt(model)
    b, s = shape
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(b, s, ad.d_model, generator=g) * 3).to(device=device, dtype=ad.dtype)

    def silence(mod):
        def fn():
            with hooks_silenced(mod):
                pass
        return fn

    o_attn = median_time(silence(model), device, repeats)
    o_ffn = median_time(silence(model.blocks[0]), device, repeats)
    ta, tf = [], []
    with torch.no_grad():
        for lay in range(ad.n_layers):
            attn, phi = ad.attention(lay), ad.ffn(lay)
            ta.append(max(median_time(lambda: attn(x), device, repeats) - o_attn, 0.0))
            tf.append(max(median_time(lambda: phi(x), device, repeats) - o_ffn, 0.0))
    return ta, tf


def paper_estimate(ta: list[float], tf: list[float], chosen: list[int]) -> float:
    t_seq = sum(a + f for a, f in zip(ta, tf))
    t_par = sum(max(a, f) if i in chosen else a + f for i, (a, f) in enumerate(zip(ta, tf)))
    return t_seq / t_par


# ----------------------------------------------------------------------------------------------------------


def mean_loss(model, tokens) -> float:
    with torch.no_grad():
        return float(next_token_loss(model(tokens, return_type="logits"), tokens).mean())


def _dce(d: float | None) -> str:
    return "n/a (random weights)" if d is None else f"{d:+.4f}"


def random_init_model(config_dir: str, backend: str, device: str, dtype: torch.dtype):
    """A random-init (seed 0) model of the architecture in ``config_dir`` (config.json + tokenizer files),
    wrapped like :func:`tl_steering.load_model` wraps an offline model (raw processing)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from tl_steering.backends.loading import ModelInfo
    from tl_steering.backends import wrap_hf

    cfg = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval().to(dtype)
    tok = AutoTokenizer.from_pretrained(config_dir)
    model = wrap_hf(hf, tok, backend, "raw", device, label="randinit", hf_config_dir=config_dir)
    model._tl_steering_info = ModelInfo(name=f"random-init:{Path(config_dir).name}", revision="random-init seed=0",
                                        processing="raw", prepend_bos=False)
    return model


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m",
                    help="smollm2-135m, gemma-3-270m (Gemma rows: add --strategy C --windows 2 --shapes 1x128 "
                         "on 2 CPU cores; docs/gemma.md), or tiny-gpt2 / tiny-llama")
    ap.add_argument("--backend", default=None, help="hooked (TL 3.9 only) or bridge; default hooked if available")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sub-repeats", type=int, default=7, help="repeats per submodule timing")
    ap.add_argument("--shapes", default="1x1,1x128,8x128")
    ap.add_argument("--controls", nargs="?", const="unfused", default="",
                    help="also time, at k = L/2, 'unfused' (fuse=False); the executor's sequential control "
                         "(lean-seq) is always timed")
    ap.add_argument("--strategy", default="best", help="plan_parallel strategy (best, C, greedy, ...)")
    ap.add_argument("--windows", type=int, default=8, help="calibration / held-out windows of 128 tokens each")
    ap.add_argument("--ks", default=None, help="comma list of k to time (default: 0, L/4, L/2)")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="parameter dtype of all three models")
    ap.add_argument("--hf-config", default=None, metavar="DIR",
                    help="time a RANDOM-INIT model built from the Hugging Face config and tokenizer in DIR (e.g. the "
                         "weight cache's directory of an offline model, without model.safetensors) instead of "
                         "--model: for a machine the weights cannot reach. Timings only (they do not depend on the "
                         "weights); the plan comes from --layers and the dCE column is not meaningful")
    ap.add_argument("--layers", default=None,
                    help="comma list: time this plan (k = its length, plus the k = 0 control) instead of planning")
    ap.add_argument("--refit", default="none", choices=["none", "gate", "affine", "linear"],
                    help="fit the plan's closed-form FFN corrections on the calibration windows "
                         "(tl_steering.parallel.refit.fit_corrections) and fold them into the parallel model "
                         "(parallelize(..., gates=, biases=)): the dCE column is then the corrected plan's, held out")
    args = ap.parse_args(argv)
    backend = args.backend or ("hooked" if hooked_available() else "bridge")
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("--device cuda but torch.cuda.is_available() is False (this torch is a CPU build?)")
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    dtype = getattr(torch, args.dtype)
    if args.hf_config:
        if not args.layers:
            sys.exit("--hf-config builds random weights: planning on them means nothing; give the plan with --layers")
        model = random_init_model(args.hf_config, backend, device, dtype)
        args.model = f"random-init {Path(args.hf_config).name}"
    elif args.model.startswith("tiny-"):
        model = ts.tiny_model(args.model.removeprefix("tiny-"), backend=backend, n_layers=8, d_model=256,
                              n_heads=8, n_ctx=256).to(device).to(dtype)
    else:
        model = ts.load_model(args.model, backend=backend, device=device, dtype=dtype)
    model.eval()
    ad = adapt(model)
    L = ad.n_layers
    print(f"# {args.model} ({backend}, TL {ts.tl_version()}, torch {torch.__version__}, device {device}, "
          f"torch threads {torch.get_num_threads()}); loaded in {time.time() - t0:.0f}s")
    calib = ts.text_tokens(model, n_windows=args.windows, length=128, seed=0)
    held = ts.text_tokens(model, n_windows=args.windows, length=128, seed=1)
    t1 = time.time()
    if args.layers:
        given = sorted({int(v) for v in args.layers.split(",")})
        ks = [0, len(given)]
        plans = {0: [], len(given): given}
        plan_info = {"strategy": "given", "requested": "--layers", "held_out_delta_ce": None, "cost": None,
                     "total_cost": None}
    else:
        ks = sorted({int(k) for k in args.ks.split(",")}) if args.ks else sorted({0, L // 4, L // 2})
        plans, plan_info = layer_plans(model, calib, held, ks, args.strategy)
    print(f"# plans ({plan_info['strategy']}, requested {args.strategy}; chosen on calibration windows, "
          f"{time.time() - t1:.0f}s): {plans}; planner cost {plan_info['cost']}")
    base_loss = mean_loss(model, held)
    pars, seqs = {}, {}
    fitted: dict[int, tuple[dict, dict, dict]] = {}
    for k in ks:
        if args.refit != "none" and plans[k]:
            from tl_steering.parallel.refit import fit_corrections

            lin: dict = {}
            g, bias, _ = fit_corrections(model, calib, plans[k], refit=args.refit, batch_size=4, linears=lin)
            fitted[k] = (g, bias, lin)
        g, bias, lin = fitted.get(k, ({}, {}, {}))
        pars[("fused", k)] = parallelize(model, plans[k], gates=g or None, biases=bias or None,
                                         linears=lin or None)
        seqs[k] = lean_sequential_copy(model, plans[k])
    if fitted:
        print(f"# {args.refit} corrections fitted on the calibration windows for k = {sorted(fitted)}")
    controls = [c for c in args.controls.split(",") if c]
    if "unfused" in controls:
        g, bias, lin = fitted.get(max(ks), ({}, {}, {}))
        pars[("unfused", max(ks))] = parallelize(model, plans[max(ks)], fuse=False, gates=g or None,
                                                 biases=bias or None, linears=lin or None)
    losses = {key: mean_loss(p, held) for key, p in pars.items()}

    rows = []
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for shape in shapes:
        b, s = shape
        decode = shape == (1, 1)
        toks = held[:b, :s] if not decode else held[:1]
        t_prefix = None
        if decode and backend == "bridge":
            # what the TL bridge computes per new token WITHOUT a working cache (its attention reads the cache only
            # as past_key_values, transformers 5.x passes cache=): the whole 128-token forward
            with torch.no_grad():
                t_prefix = median_time(lambda: model(toks), device, args.repeats)
            print(f"# 1x1 decode on the bridge: TL / exec-seq / exec-par = one cached step each (Hugging Face "
                  f"DynamicCache, frozen at {toks.shape[1] - 1} tokens; tl_steering.backends.decode_step routes the "
                  f"cache to TL's attention bridges, which ignore it otherwise). Without the routing the bridge has "
                  f"no usable cache: its full {toks.shape[1]}-token forward per new token takes {t_prefix * 1e3:.2f} "
                  f"ms = {1 / t_prefix:.1f} tokens/s", flush=True)
        sub_shape = (1, 1) if decode else shape
        ta, tf = submodule_times(model, sub_shape, device, args.sub_repeats)
        for (mode, k), p in pars.items():
            seq = seqs[k]
            routed = contextlib.ExitStack()
            if decode:  # one step after a frozen 127-token KV cache (TL's cache on HookedTransformer, HF's on the bridge)
                fns = []
                for mdl in (model, seq, p):
                    c = kv_cache(mdl, 1)
                    with torch.no_grad():
                        decode_step(mdl, toks[:, :-1], c)
                    freeze_kv_cache(c)
                    routed.enter_context(cache_routing(mdl))  # held while timing: decode_step does not re-route
                    fns.append(lambda c=c, mdl=mdl: decode_step(mdl, toks[:, -1:], c))
                n_tok = 1
            else:
                fns = [lambda mdl=mdl: mdl(toks) for mdl in (model, seq, p)]
                n_tok = b * s
            with torch.no_grad(), routed:
                t_tl, t_seq, t_par = rr_medians(fns, device, args.repeats)
            chosen = plans[k]
            est = paper_estimate(ta, tf, chosen)
            row = dict(shape=f"{b}x{s}" + (" decode" if decode else ""), mode=mode, k=k, layers=chosen,
                       strategy=plan_info["strategy"], t_tl_ms=t_tl * 1e3, t_seq_ms=t_seq * 1e3,
                       t_par_ms=t_par * 1e3, tok_s_tl=n_tok / t_tl, tok_s_seq=n_tok / t_seq,
                       tok_s_par=n_tok / t_par, speedup_vs_tl=t_tl / t_par, speedup_vs_seq=t_seq / t_par,
                       estimate=est, dloss=None if args.hf_config else losses[(mode, k)] - base_loss,
                       attn_ffn_ms=(sum(ta) * 1e3, sum(tf) * 1e3))
            if t_prefix is not None:  # bridge decode: the TL bridge's cache-less cost per new token (full forward)
                row.update(t_tl_prefix_ms=t_prefix * 1e3, tok_s_tl_prefix=1 / t_prefix,
                           speedup_vs_tl_prefix=t_prefix / t_par)
            rows.append(row)
            print(f"  {row['shape']:>11} {mode:>7} k={k:>2}: TL {row['t_tl_ms']:8.2f} ms  exec-seq "
                  f"{row['t_seq_ms']:8.2f} ms  exec-par {row['t_par_ms']:8.2f} ms  speedup vs TL "
                  f"{row['speedup_vs_tl']:.3f}  vs exec-seq {row['speedup_vs_seq']:.3f}  estimate {est:.3f}  "
                  f"dCE {_dce(row['dloss'])}", flush=True)

    print()
    print("| shape | mode | k | t TL ms | t exec-seq ms | t exec-par ms | tok/s TL | tok/s exec-seq | tok/s exec-par | "
          "measured speedup vs TL model | measured speedup vs executor's sequential model | estimate | "
          "ΔCE (held-out) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['mode']} | {r['k']} | {r['t_tl_ms']:.2f} | {r['t_seq_ms']:.2f} | "
              f"{r['t_par_ms']:.2f} | {r['tok_s_tl']:.0f} | {r['tok_s_seq']:.0f} | {r['tok_s_par']:.0f} | "
              f"{r['speedup_vs_tl']:.3f}x | {r['speedup_vs_seq']:.3f}x | {r['estimate']:.3f}x | {_dce(r['dloss'])} |")
    for shape in shapes:
        rr = [r for r in rows if r["shape"].startswith(f"{shape[0]}x{shape[1]}")]
        if rr:
            a, f = rr[0]["attn_ffn_ms"]
            print(f"# {rr[0]['shape']}: sum t_attn = {a:.2f} ms, sum t_ffn = {f:.2f} ms (t_attn/t_ffn = {a / f:.2f})")
    print(f"# base held-out CE {base_loss:.4f}; torch threads {torch.get_num_threads()}; total {time.time() - t0:.0f}s")
    out = dict(model=args.model, backend=backend, device=device, tl=ts.tl_version(), torch=torch.__version__,
               refit=args.refit,
               threads=torch.get_num_threads(), plans={str(k): v for k, v in plans.items()}, plan=plan_info,
               base_loss=base_loss, rows=rows)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()

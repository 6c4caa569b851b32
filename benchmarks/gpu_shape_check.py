"""GPU check that needs no pretrained weights: a random-init Llama of SmolLM2-135M's block shape on a device.

    python benchmarks/gpu_shape_check.py --device cuda [--n-layers 30] [--repeats 30] [--json out.json]

For machines that cannot receive the offline weights (a lent GPU machine takes a 64 MiB working tree). Timing does
not depend on the weights' values, so the executor's speedup is measured on the real block shape (d_model 576,
d_mlp 1536, 8 heads / 4 KV heads here -- SmolLM2 has 9 / 3 --, 30 layers; the vocabulary is the byte tokenizer's
257, so the unembedding is far cheaper than SmolLM2's 49k and the blocks are nearly the whole forward). Prints:

1. the device is honoured: ``wrap_hf(..., device)`` puts every parameter there and ``cfg.device`` agrees;
2. protocols on the device equal the same model on the CPU (angular deficit, FFN ablation, defect scores and the
   gold standard, the probe) to float32 roundoff;
3. ``parallelize(model, plan)`` equals the ``parallel_blocks`` hook surrogate on the device (max |diff| of logits
   relative to the logits' scale);
4. forward wall times (median of ``--repeats`` after warm-up, synchronized) of the TL model and the parallel
   executor at 1x1, 1x128 and 8x128 for k = 0 (an A/A copy) and k = L/2, and the speedup.
"""

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, not an installed one

import tl_steering as ts  # noqa: E402
from tl_steering.backends import adapt
from tl_steering.backends.loading import tiny_hf_model
from tl_steering.backends import wrap_hf
from tl_steering.hooks import parallel_blocks


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _median_s(fn, device: str, repeats: int) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--n-layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    sizes = dict(n_layers=args.n_layers, d_model=576, n_heads=8, d_mlp=1536, n_ctx=256)
    out: dict = {"device": args.device, "sizes": sizes}
    hf, tok = tiny_hf_model("llama", seed=0, **sizes)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    dev_model = wrap_hf(hf, tok, "bridge", "raw", args.device, label="shape")
    devices = sorted({str(p.device) for p in dev_model.parameters()})
    out["parameter_devices"], out["cfg_device"] = devices, str(dev_model.cfg.device)
    print(f"1. device asked {args.device}: parameters on {devices}, cfg.device {dev_model.cfg.device}", flush=True)

    hf_cpu, _ = tiny_hf_model("llama", seed=0, **sizes)
    hf_cpu.load_state_dict(state)
    cpu_model = wrap_hf(hf_cpu, tok, "bridge", "raw", "cpu", label="shape")
    tokens = torch.randint(1, 257, (4, 64), generator=torch.Generator().manual_seed(0))
    diffs = {}
    on = lambda m: tokens.to(adapt(m).device)  # noqa: E731 - tokens live where the model is (else a clear error)
    d_c, d_d = (ts.angular_deficit(m, on(m), n_bootstrap=0).deficit.cpu() for m in (cpu_model, dev_model))
    diffs["deficit"] = float((d_c - d_d).abs().max())
    a_c, a_d = (ts.ffn_ablation(m, on(m), n_bootstrap=0, include_random_tangent=False).delta_loss
                for m in (cpu_model, dev_model))
    diffs["ablation_delta_loss"] = max(abs(a_c[k] - a_d[k]) for k in a_c)
    layers = list(range(0, args.n_layers, max(1, args.n_layers // 6)))
    f_c, f_d = (ts.parallel_defect(m, on(m), layers=layers, evaluate=True, k_values=[1, 2], n_random=0)
                for m in (cpu_model, dev_model))
    diffs["defect_C_rel"] = _rel(f_d.score, f_c.score)
    diffs["defect_delta_ce"] = float((f_c.delta_ce.cpu() - f_d.delta_ce.cpu()).abs().max())
    res = []
    for m in (cpu_model, dev_model):
        with ts.probe(m, layers=layers) as tr, torch.no_grad():
            m(tokens.to(adapt(m).device))
        res.append(tr.result())
    diffs["probe_resid_norm_rel"] = max(_rel(res[1].get(q), res[0].get(q)) for q in res[0].quantities
                                        if q.startswith("resid_norm"))
    out["cpu_vs_device"] = diffs
    print(f"2. CPU vs {args.device}: {diffs}", flush=True)

    plan = list(range(1, args.n_layers, 2))  # k = L/2: every other layer
    par = ts.parallelize(dev_model, plan)
    tdev = tokens.to(adapt(dev_model).device)
    with torch.no_grad():
        surrogate = dev_model.run_with_hooks(tdev, fwd_hooks=parallel_blocks(dev_model, plan))
        executor = par(tdev)
    out["executor_vs_surrogate_rel"] = _rel(executor, surrogate)
    print(f"3. parallelize vs parallel_blocks surrogate (k={len(plan)}): max rel diff "
          f"{out['executor_vs_surrogate_rel']:.2e}", flush=True)

    aa = ts.parallelize(dev_model, [])
    rows = []
    for shape in ((1, 1), (1, 128), (8, 128)):
        t = torch.randint(1, 257, shape, generator=torch.Generator().manual_seed(1)).to(adapt(dev_model).device)
        with torch.no_grad():
            t_tl = _median_s(lambda: dev_model(t), args.device, args.repeats)
            t_aa = _median_s(lambda: aa(t), args.device, args.repeats)
            t_par = _median_s(lambda: par(t), args.device, args.repeats)
        row = {"shape": f"{shape[0]}x{shape[1]}", "t_tl_ms": 1e3 * t_tl, "t_exec_k0_ms": 1e3 * t_aa,
               "t_exec_par_ms": 1e3 * t_par, "speedup_vs_tl": t_tl / t_par, "speedup_vs_exec_k0": t_aa / t_par}
        rows.append(row)
        print(f"4. {row['shape']:>6}: TL {row['t_tl_ms']:8.2f} ms  executor k=0 {row['t_exec_k0_ms']:8.2f} ms  "
              f"executor k={len(plan)} {row['t_exec_par_ms']:8.2f} ms  speedup vs TL {row['speedup_vs_tl']:.3f}x  "
              f"vs executor k=0 {row['speedup_vs_exec_k0']:.3f}x", flush=True)
    out["timings"] = rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()

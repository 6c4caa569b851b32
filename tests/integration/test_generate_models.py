"""TransformerLens's ``generate`` on the real offline models (docs/generate.md): 20 greedy tokens with the KV cache
equal to an independent Hugging Face model's (the wrapped Hugging Face model cannot be the reference: the bridge
replaced its modules), and a parallelized copy with a fitted linear correction equal to the hook surrogate's greedy
tokens (one full forward per token, no cache).

Integration backend (bridge on TL 4.3, HookedTransformer on TL 3.9; the TL 3.9 bridge is covered on the tiny models
of tests/unit/backends/test_decoding_generate.py). Cost: one extra Hugging Face model per architecture, 2 x 20 cached steps, 20
surrogate forwards of <= 27 tokens, one correction fit on 2 x 64 tokens, one parallelized copy (Gemma ~50 s, SmolLM2
~25 s on the shared 2-core machine, contaminated). Memory: at most one extra copy of the model at a time (the
Hugging Face reference is freed before the parallelized copy is made, and that one before the surrogate runs).
"""

import gc

import pytest
import torch

from tests.helpers import assert_no_hooks
from tl_steering.backends.loading import _offline_hf
from tl_steering.hooks import parallel_blocks
from tl_steering.parallel import parallelize
from tl_steering.parallel.refit import fit_corrections

pytestmark = pytest.mark.integration

PROMPT = "The capital of France is"
NEW = 20


def _greedy(model, prompt: torch.Tensor, cache: bool) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=NEW, do_sample=False, use_past_kv_cache=cache, verbose=False,
                          stop_at_eos=False)


def _hf_greedy(name: str, prompt: torch.Tensor) -> torch.Tensor:
    """Greedy tokens of a fresh Hugging Face model, freed before returning (Gemma: ~1 GB per float32 copy)."""
    hf = _offline_hf(name, torch.float32)[0]
    with torch.no_grad():
        out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False)
    del hf
    gc.collect()
    return out


def _surrogate_greedy(model, prompt: torch.Tensor, layers, gates, biases, linears) -> torch.Tensor:
    seq = prompt
    with torch.no_grad():
        for _ in range(NEW):
            logits = model.run_with_hooks(seq, fwd_hooks=parallel_blocks(model, layers, gates, biases, linears))
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


def _check(model, name: str, tokens: torch.Tensor, layers: list[int], answer: str) -> None:
    prompt = model.to_tokens(PROMPT)
    ref = _hf_greedy(name, prompt)
    assert model.tokenizer.decode(ref[0, prompt.shape[1]:]).startswith(answer)
    assert torch.equal(_greedy(model, prompt, True), ref)  # without the cache: the tiny models (suite budget)
    # a parallelized copy with the linear correction fitted on 2 windows: the hook surrogate's tokens
    lin: dict = {}
    gates, biases, _ = fit_corrections(model, tokens, layers, refit="linear", batch_size=2, linears=lin)
    par = parallelize(model, layers, gates=gates, biases=biases, linears=lin)
    got = _greedy(par, prompt, True)
    del par  # one extra copy of the model at a time
    gc.collect()
    assert torch.equal(got, _surrogate_greedy(model, prompt, layers, gates, biases, lin))
    assert_no_hooks(model)


@pytest.mark.one_line("tl4")
def test_smollm2_generate(smollm2, smollm2_tokens):
    # the bug this guards against: "Paris-----------" with the cache (TL 4.3 bridge, transformers 5.24)
    _check(smollm2, "smollm2-135m", smollm2_tokens[:2, :64], [20, 21, 22, 23], " Paris.")


@pytest.mark.one_line("tl4")
def test_gemma_generate(gemma, gemma_tokens):
    _check(gemma, "gemma-3-270m", gemma_tokens, [3, 5, 11], " the capital of the country of France.")

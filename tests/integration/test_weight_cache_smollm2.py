"""SmolLM2-135M through the dequantized-weight cache (tl_steering/backends/weight_cache.py): the entry the session
model came from is keyed by the GGUF's sha256 and verifies; the model rebuilt from it holds exactly the stored
tensors (tied head included). Bitwise equality with a cold dequantization is checked by benchmarks/load_time.py
(a cold dequantization costs about 40 s); the pinned SmolLM2 values check the numbers end to end.
Cost: about 3 s (a warm rebuild of the Hugging Face model).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tl_steering.backends import loading, weight_cache

pytestmark = pytest.mark.integration


def test_smollm2_comes_from_a_verified_entry_keyed_by_the_gguf(smollm2):
    # the session fixture filled the cache; this rebuild verifies the entry's hashes once more on the way
    hf, _, entry, revision = loading._offline_hf("smollm2-135m", torch.float32)
    entry = Path(entry)
    manifest = json.loads((entry / weight_cache.MANIFEST_FILE).read_text())
    assert manifest["key"]["source_sha256"] == weight_cache.file_sha256(loading.smollm2_gguf_path())
    assert manifest["key"]["dtype"] == "float32"
    assert revision == smollm2._tl_steering_info.revision
    assert not [p for p in entry.parent.iterdir() if ".tmp-" in p.name], "no temporary build directory left"

    stored = load_file(Path(entry) / weight_cache.WEIGHTS_FILE)
    state = hf.state_dict()
    assert set(stored) <= set(state) and len(stored) >= 270
    for k, v in stored.items():
        assert torch.equal(state[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    assert set(state) - set(stored) == {"lm_head.weight"}  # tied: stored once
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()

"""The hook-factory checks of tests/unit/test_hooks.py on the real SmolLM2-135M (fp32, <= 1e-5 relative)."""

import pytest

from tests.unit.test_hooks import CHECKS, assert_no_hooks

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokens(smollm2_tokens):
    return smollm2_tokens[:2, :64]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__.removeprefix("check_") for c in CHECKS])
def test_hook_factory_smollm2(smollm2, tokens, check):
    assert_no_hooks(smollm2)
    check(smollm2, tokens)
    assert_no_hooks(smollm2)

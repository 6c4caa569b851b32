"""backends/autodiff.py: torch.func transforms inside a section that holds signals and unwinds leftover autodiff state
(docs/hooks.md, "Interrupts": "Autodiff transforms"). The stress test on a model is
tests/reliability/test_autodiff_interrupts.py."""

import signal
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwad
from torch._functorch import eager_transforms

from tl_steering.backends import autodiff
from tl_steering.backends.autodiff import autodiff_section, autodiff_state


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    old = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def _idle(state):
    """No transform entered: no functorch layer, no JVP nesting, no forward-AD level."""
    return (state.depth, state.jvp_nesting, state.fwd_level) == (0, 0, -1)


def _f(x):
    return torch.tanh(x) * x.sum()


def test_the_wrappers_compute_what_torch_func_computes():
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    v = torch.ones_like(x[0])
    ref = torch.func.vmap(torch.func.jacrev(_f))(x)
    torch.testing.assert_close(autodiff.vmap(autodiff.jacrev(_f))(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(autodiff.jacfwd(_f)(x[0]), torch.func.jacfwd(_f)(x[0]), rtol=0, atol=0)
    out, t = autodiff.jvp(_f, (x[0],), (v,))
    ref_out, ref_t = torch.func.jvp(_f, (x[0],), (v,))
    torch.testing.assert_close((out, t), (ref_out, ref_t), rtol=0, atol=0)
    with warnings.catch_warnings():  # torch.fx const-folding chatter (as in critical/fields.py)
        warnings.simplefilter("ignore", UserWarning)
        _, jvp_fn = autodiff.linearize(_f, x[0])
    torch.testing.assert_close(jvp_fn(v), ref_t, rtol=1e-12, atol=1e-12)
    # inside a transform of the caller's own (the section restores only to its entry state)
    outer = torch.func.jacrev(lambda y: autodiff.jvp(_f, (y,), (v,))[1])(x[0])
    torch.testing.assert_close(outer, torch.func.jacrev(lambda y: torch.func.jvp(_f, (y,), (v,))[1])(x[0]))
    assert _idle(autodiff_state())


def test_a_signal_inside_a_section_is_delivered_right_after_it():
    ran_on = []
    with pytest.raises(KeyboardInterrupt):
        with autodiff_section():
            signal.raise_signal(signal.SIGINT)  # held: the transform runs to its end
            ran_on.append(autodiff.jvp(_f, (torch.ones(3),), (torch.ones(3),))[1])
    assert len(ran_on) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.parametrize("leak", ["jvp_layer_and_level", "cxx_level_only", "vmap_layer", "jvp_nesting_only"])
def test_an_exception_leaving_a_section_unwinds_what_a_transform_left_entered(leak):
    """What a KeyboardInterrupt inside torch.func's own bookkeeping leaves (simulated with torch's own calls): a
    functorch layer, a forward-AD level (also one in C++ that its Python mirror does not show), the JVP counter,
    forward-gradient mode. The section's exit puts all of it back, and the next jvp works."""
    before = autodiff_state()
    sec = autodiff_section()
    with pytest.raises(KeyboardInterrupt):
        with sec:
            if leak == "jvp_layer_and_level":
                torch._C._functorch._jvp_increment_nesting()
                eager_transforms.JVP_NESTING += 1
                torch._C._set_fwd_grad_enabled(False)
                fwad.enter_dual_level()
            elif leak == "cxx_level_only":
                torch._C._enter_dual_level()
            elif leak == "vmap_layer":
                torch._C._functorch._vmap_increment_nesting(2, "error")
            else:
                eager_transforms.JVP_NESTING -= 1
            raise KeyboardInterrupt
    assert sec.unwound
    assert autodiff_state() == before
    x = torch.ones(3)
    torch.testing.assert_close(torch.func.jvp(torch.sin, (x,), (x,))[1], torch.cos(x))
    torch.testing.assert_close(torch.func.vmap(torch.sin)(x[:, None]), torch.sin(x)[:, None])


def test_an_ordinary_error_in_a_transform_leaves_nothing_to_unwind():
    sec = autodiff_section()
    with pytest.raises(RuntimeError):
        with sec:
            autodiff.vmap(lambda r: torch.tensor(float(r.sum())))(torch.ones(2, 3))  # .item() under vmap
    assert not sec.unwound
    assert _idle(autodiff_state())

"""The direct launcher's key: exactly the properties Triton specializes a kernel on."""
import pytest
import torch
import triton
from triton.backends.nvidia.compiler import CUDABackend
from triton._C.libtriton import native_specialize_impl

from loraplex.ops import launch


def test_key_separates_what_triton_specializes_on():
    values = [1, 0, 16, 17, 32, -5, 2**31 - 16, 2**31, 2**40 + 3]
    tensor = torch.empty(64, dtype=torch.bfloat16)
    values += [tensor, tensor[1:], tensor[8:], tensor.float(), tensor.half()[3:]]
    for a in values:
        for b in values:
            same_triton = native_specialize_impl(CUDABackend, a, False, True, True) == \
                native_specialize_impl(CUDABackend, b, False, True, True)
            assert (launch._spec(a) == launch._spec(b)) == same_triton, (a if not isinstance(a, torch.Tensor) else
                                                                         a.data_ptr(), b if not isinstance(
                                                                             b, torch.Tensor) else b.data_ptr())


def test_plain_key_separates_what_triton_keeps_of_an_unspecialized_int():
    """Parameters marked do_not_specialize (the prefill kernel's sequence count): only the width counts."""
    values = [1, 0, 16, 17, 32, -5, 2**31 - 16, 2**31, 2**40 + 3, 2**63]
    for a in values:
        for b in values:
            same_triton = native_specialize_impl(CUDABackend, a, False, False, True) == \
                native_specialize_impl(CUDABackend, b, False, False, True)
            assert (launch._plain_spec(a) == launch._plain_spec(b)) == same_triton, (a, b)


def test_default_hooks_do_not_count_as_installed():
    assert not launch._hooks_installed()


@pytest.mark.parametrize("value, enabled", [(None, None), ("auto", None), ("on", True), ("1", True), ("off", False),
                                            ("0", False)])
def test_fast_launch_setting(value, enabled, monkeypatch):
    """LORAPLEX_FAST_LAUNCH (envs.py): auto (the default) takes direct launches with the Triton versions they were
    checked against; on and off force them."""
    if value is None:
        monkeypatch.delenv("LORAPLEX_FAST_LAUNCH", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_FAST_LAUNCH", value)
    auto = triton.__version__.startswith(launch.FAST_TRITON_VERSIONS)
    assert launch._fast_enabled() is (auto if enabled is None else enabled)


def test_inside_compile_ahead_launcher_calls_launch_nothing(caplog):
    """In Triton's interpreter (the CPU) there is nothing to compile: an add_lora inside `compile_ahead` leaves y
    as it was, the same call after it adds the LoRA. `precompile` runs its calls that way, and a failure there is
    a warning, not an error (the real launches after it report real ones)."""
    import numpy as np

    from loraplex.ops import triton_interpreted
    from loraplex.ops.lora import sgmv
    from lora_cases import make_case, rel_err
    if not triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (no CUDA)")
    case = make_case(np.random.default_rng(3), seg_lens=[2, 3], popularity="distinct", K=32, Ns=(24,), R=8)
    y, batch = case.y0.clone(), case.batch()
    with launch.compile_ahead(workers=2):
        sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, 0)
        assert launch._AHEAD
    assert torch.equal(y, case.y0) and not launch._AHEAD
    launch.precompile(lambda: sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings,
                                            0))
    assert torch.equal(y, case.y0)
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, 0)
    assert rel_err(y, case.oracle(), case.y0) <= 1e-5

    def broken():
        raise RuntimeError("no such variant")
    with caplog.at_level("WARNING", logger="loraplex.ops"):
        launch.precompile(broken)
    assert "compiling kernels ahead failed (RuntimeError: no such variant)" in caplog.text and not launch._AHEAD

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

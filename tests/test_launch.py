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


def _direct_launcher(monkeypatch, interpreted):
    """A Launcher of a real JITFunction (built from the interpreted kernel's source) on its direct path, whose
    `_launch` records (args, specs, ordered constexprs, raw) instead of launching."""
    from triton.runtime.jit import JITFunction
    kernel = interpreted if type(interpreted).__name__ == "JITFunction" else JITFunction(interpreted.fn,
                                                                                         **interpreted.kwargs)
    monkeypatch.setattr(launch, "_fast_enabled", lambda: True)
    launcher = launch.Launcher(kernel)
    seen = []

    def record(grid, args, constexprs, warps, stages, specs, ordered, raw=None):
        seen.append((list(args), list(specs), ordered, raw))
    monkeypatch.setattr(launcher, "_launch", record)
    return launcher, seen


def _addresses(args):
    return [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]


def test_prepared_launch_keys_its_arguments_as_a_plain_launch_does(monkeypatch):
    """`launcher.prepare(...)(*values)` launches what a plain launch of the same call would, keyed by the same specs:
    the dynamic values (an unaligned view among them) where given, the prepared ones elsewhere, a do_not_specialize
    int keyed by its width only; the compiled kernel gets each tensor as its address; and the prepared launch keeps
    none of the first call's dynamic tensors alive."""
    from loraplex.ops.lora import sgmv
    launcher, seen = _direct_launcher(monkeypatch, sgmv._sgmv_expand_kernel)
    n = len(launcher.kernel.arg_names) - len(launcher._const_names)
    t = torch.randn(64, dtype=torch.float32)
    args = [t if i % 3 else 16 * i + 1 for i in range(n)]
    plain_pos = launcher._plain[0]
    args[plain_pos] = 1   # a do_not_specialize int: 1 is keyed like any other int32
    constexprs = {name: i for i, name in enumerate(launcher._const_names)}
    dynamic = (0, 1, 2, plain_pos)
    prepared = launcher.prepare((3,), tuple(args), constexprs, 4, 2, dynamic)
    assert all(prepared.args[i] is None for i in dynamic)
    calls = [(torch.randn(8), torch.randn(8, dtype=torch.float16)[1:], 32, 2**40),
             (torch.randn(8), torch.randn(8, dtype=torch.float16), 17, 5)]
    for values in calls:
        prepared(*values)
        launched, specs, ordered, raw = seen.pop()
        expected = list(args)
        for i, v in zip(dynamic, values):
            expected[i] = v
        launcher((3,), tuple(expected), constexprs, 4, 2)   # the plain launch of the same call, recorded
        plain_args, plain_specs, plain_ordered, plain_raw = seen.pop()
        assert len(launched) == len(plain_args) and all(a is b for a, b in zip(launched, plain_args))
        assert specs == plain_specs and ordered == plain_ordered
        assert plain_raw is None and raw == _addresses(expected)
    assert launch._spec(calls[0][1]) != launch._spec(calls[1][1])
    with pytest.raises(TypeError, match="takes 4 dynamic arguments, got 3"):
        prepared(*calls[0][:3])
    with pytest.raises(ValueError, match="dynamic positions must be distinct, ascending"):
        launcher.prepare((3,), tuple(args), constexprs, 4, 2, (2, 1))


def test_sgmv_launches_over_a_batch_are_prepared_once_and_key_each_calls_tensors(monkeypatch):
    """add_lora builds its two launches at a batch's first call and reuses them for later calls of the same shapes
    (one entry a launch in `batch.launches`); each call's tensors reach the kernel at their slices' places and its
    key, an unaligned x of the same strides included; the unused slices get placeholders; and a batch's `update_`
    drops the launches."""
    import numpy as np

    from loraplex.ops import LoraBatch
    from loraplex.ops.lora import sgmv
    from lora_cases import make_case
    shrink, shrink_seen = _direct_launcher(monkeypatch, sgmv._sgmv_shrink_kernel)
    expand, expand_seen = _direct_launcher(monkeypatch, sgmv._sgmv_expand_kernel)
    monkeypatch.setattr(sgmv, "_SHRINK", shrink)
    monkeypatch.setattr(sgmv, "_EXPAND", expand)
    case = make_case(np.random.default_rng(5), seg_lens=[3, 2, 4], popularity="distinct", K=32, Ns=(24, 16), R=8)
    batch = case.batch()
    shifted = torch.randn(case.x.numel() + 1, dtype=case.x.dtype)[1:].view(case.x.shape)
    clone = lambda ts: [t.clone() for t in ts]   # noqa: E731
    calls = [(case.x, case.lora_a, case.lora_b, case.ranks, case.scalings),
             # the second: the same shapes and strides, x one element off 16-byte alignment, every tensor new
             (shifted, clone(case.lora_a), clone(case.lora_b), clone(case.ranks), clone(case.scalings))]
    S, M = len(case.lora_a), sgmv.MAX_SLICES
    for x, lora_a, lora_b, ranks, scalings in calls:
        y = case.y0.clone()
        sgmv.add_lora(y, x, lora_a, lora_b, batch, ranks, scalings, 0)
        (s_args, s_specs, _, s_raw), (e_args, e_specs, _, e_raw) = shrink_seen.pop(), expand_seen.pop()
        assert s_args[0] is x and e_args[0] is y and s_args[1] is e_args[1]   # part: the shrink's output
        assert all(s_args[8 + i] is lora_a[i] and s_args[8 + M + i] is ranks[i] for i in range(S))
        assert all(e_args[7 + i] is lora_b[i] and e_args[7 + M + i] is ranks[i] and e_args[7 + 2 * M + i] is
                   scalings[i] for i in range(S))
        pads = [s_args[8 + i] for i in range(S, M)] + [e_args[7 + 2 * M + i] for i in range(S, M)]
        assert all(p is sgmv._placeholder(p.device, p.dtype) for p in pads)
        assert s_specs[0] == launch._spec(x) and s_raw == _addresses(s_args) and e_raw == _addresses(e_args)
        for launcher, seen, args, specs in ((shrink, shrink_seen, s_args, s_specs), (expand, expand_seen, e_args,
                                                                                      e_specs)):
            prepared = next(v for v in batch.launches.values() if getattr(v, "launcher", None) is launcher)
            launcher(prepared.grid, tuple(args), prepared.constexprs, prepared.num_warps, prepared.num_stages)
            assert seen.pop()[1] == specs   # the plain launch of the same arguments keys them alike
    assert launch._spec(case.x) != launch._spec(shifted)
    assert sum(k[0] in ("shrink", "expand") for k in batch.launches) == 2
    capacity = LoraBatch.with_capacity(16, 4, "cpu", num_slots=8)
    sgmv.add_lora(torch.zeros(16, 40), torch.randn(16, 32), case.lora_a, case.lora_b, capacity, case.ranks,
                  case.scalings, 0)
    assert capacity.launches
    capacity.update_([5], [1])
    assert not capacity.launches

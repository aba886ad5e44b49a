"""x quantized where it is made: the RMSNorm ops fill `e4m3` (ops/gemm/fp8.py's QuantizedRows) with their output
quantized a row, bit for bit `fp8.quantize_rows(normed)`, and the FP8 GEMMs that would quantize x take those rows
instead (`x_e4m3`) with the same bits out. The layer hands them over where its GEMM quantizes (W8A8)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex import ops
from loraplex.ops.fused import api as fused
from loraplex.ops.fused import kernels as fused_kernels
from loraplex.ops.fused import lora_kernels as fused_lora_kernels
from loraplex.ops.gemm import fp8, skinny
from loraplex.ops.gemm.fp8 import FP8, Fp8Matrix, QuantizedRows, quantize_rows
from loraplex.ops.lora.delta import LoraDelta

from lora_cases import stable_seed
from test_fused_ops import rows_with_scales
from test_lora_product import make_product

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
BACKENDS = ["reference", pytest.param("triton", marks=interpreted)]


def _assert_quantized_rows(e4m3: QuantizedRows, normed: torch.Tensor, what: str) -> None:
    q, scale = quantize_rows(normed)
    assert torch.equal(e4m3.scale, scale), f"{what}: scales differ"
    assert torch.equal(e4m3.q.view(torch.uint8), q.view(torch.uint8)), f"{what}: e4m3 bytes differ"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("delta, residual, H, max_block, split", [
    (None, True, 200, None, None), (None, False, 96, None, None), ("dense", True, 200, None, None),
    ("lora_delta", True, 200, None, None), ("product", True, 200, None, None), ("product", False, 96, None, None),
    ("product", True, 200, None, 64), (None, True, 200, 64, None), ("product", True, 200, 64, 64)])
def test_rms_norm_quantizes_the_rows_it_writes(backend, dtype, delta, residual, H, max_block, split, monkeypatch):
    """Every RMSNorm path (plain, a dense or LoraDelta delta, a LoraProduct's two launches, its rows over chunks of
    `split` columns; rows past the one-pass width, `max_block`, by a launch of their own): normed and s as without
    `e4m3`, and `e4m3` holds normed quantized a row by quantize_rows, bit for bit. Rows of very different sizes, and
    one all zero (its scale 1)."""
    gen = torch.Generator().manual_seed(stable_seed("rms-e4m3", str(dtype), delta, residual, H, max_block, split))
    if max_block:
        monkeypatch.setattr(fused_kernels, "RMS_MAX_BLOCK", max_block)
    if split:
        monkeypatch.setattr(fused_lora_kernels, "RMS_SPLIT", split)
    T = 9
    x = rows_with_scales(gen, T, H, dtype, large=False) * torch.logspace(-2, 2, T)[:, None].to(dtype)
    x[3] = 0
    r = rows_with_scales(gen, T, H, dtype, large=False) if residual else None
    if r is not None:
        r[3] = 0
    w = (1 + 0.3 * torch.randn(H, generator=gen)).to(dtype)
    d = None
    if delta == "dense":
        d = torch.randn(T, H, generator=gen)
        d[3] = 0
    elif delta == "lora_delta":
        row_slot = torch.tensor([0, -1, 2, -1, 1, 0, -1, 3, 1], dtype=torch.int32)
        d = LoraDelta(torch.randn(T, H, generator=gen), row_slot)
    elif delta == "product":
        d = make_product(gen, T, (H,), dtype, sizes=x.float().abs().mean(1) + 1e-3)
        d = dataclasses.replace(d, row_slot=torch.where(torch.arange(T) == 3, -1, d.row_slot))
    e4m3 = QuantizedRows(torch.full((T, H), float("nan")).to(FP8), torch.full((T, 1), float("nan")))
    out, s = fused.rms_norm(x, w, 1e-6, residual=r, delta=d, e4m3=e4m3, backend=backend)
    want, want_s = fused.rms_norm(x, w, 1e-6, residual=r, delta=d, backend=backend)
    assert torch.equal(out, want) and torch.equal(s, want_s)
    _assert_quantized_rows(e4m3, out, f"{backend} {delta}")
    assert e4m3.scale[3].item() == 1.0 and not e4m3.q[3].float().any()   # the all-zero row
    assert e4m3.scale.float().std() > 0   # the rows' sizes differ, and so do their scales


def test_rms_norm_refuses_buffers_that_do_not_fit_by_name():
    x, w = torch.randn(4, 32).half(), torch.ones(32).half()
    for bad in (QuantizedRows(torch.empty(4, 16, dtype=FP8), torch.empty(4, 1)),
                QuantizedRows(torch.empty(4, 32), torch.empty(4, 1)),
                QuantizedRows(torch.empty(4, 32, dtype=FP8), torch.empty(4))):
        with pytest.raises(ValueError, match="e4m3 must be contiguous"):
            fused.rms_norm(x, w, 1e-6, e4m3=bad)


def _matrix(gen, N: int, K: int) -> Fp8Matrix:
    q, s = quantize_rows(torch.randn(N, K, generator=gen) * 0.05)
    return Fp8Matrix(q, s, (1, K))


@interpreted
def test_the_decode_kernel_takes_x_quantized_beforehand(monkeypatch):
    """fp8_skinny_linear(quantize_x=True, x_e4m3=quantize_rows(x)) gives the bits of quantizing x itself, and runs no
    quantization of its own; x_e4m3 without quantize_x, or of the wrong shape, is refused by name."""
    gen = torch.Generator().manual_seed(stable_seed("skinny-e4m3"))
    x = (torch.randn(5, 64, generator=gen) * torch.logspace(-2, 2, 5)[:, None]).half()
    m, bias = _matrix(gen, 48, 64), torch.randn(48, generator=gen).half()
    want = fp8.fp8_skinny_linear(x, m, bias, quantize_x=True)
    given = QuantizedRows(*quantize_rows(x))
    monkeypatch.setattr(fp8, "quantize_rows", lambda t: pytest.fail("quantized x again"))
    assert torch.equal(fp8.fp8_skinny_linear(x, m, bias, quantize_x=True, x_e4m3=given), want)
    with pytest.raises(ValueError, match="quantize_x is off"):
        fp8.fp8_skinny_linear(x, m, bias, x_e4m3=given)
    with pytest.raises(ValueError, match="x_e4m3 must be contiguous"):
        fp8.fp8_skinny_linear(x[:4], m, bias, quantize_x=True, x_e4m3=given)


def test_linear_passes_the_rows_only_where_it_quantizes(monkeypatch):
    """fp8.linear: `quantizes_x` says where the GEMM quantizes x (W8A8 "on": the prompt GEMM on the CPU; "off": never),
    and the rows given then give the bits of quantizing x itself; a dense weight refuses them."""
    from loraplex.ops.gemm import linear as gemm
    gen = torch.Generator().manual_seed(stable_seed("linear-e4m3"))
    x, m = torch.randn(40, 64, generator=gen).bfloat16(), _matrix(gen, 48, 64)
    monkeypatch.setattr(fp8, "W8A8", "on")
    assert fp8.quantizes_x(x, m) and fp8.route(x, m) == fp8.PROMPT_W8A8
    want = fp8.linear(x, m)
    given = QuantizedRows(*quantize_rows(x))
    monkeypatch.setattr(fp8, "quantize_rows", lambda t: pytest.fail("quantized x again"))
    assert torch.equal(fp8.linear(x, m, x_e4m3=given), want)
    monkeypatch.setattr(fp8, "W8A8", "off")
    assert not fp8.quantizes_x(x, m) and fp8.route(x, m) == fp8.DEQUANTIZED
    with pytest.raises(ValueError, match="dequantizes the weight"):   # (no GEMM quantizes x: rows not taken)
        fp8.linear(x, m, x_e4m3=given)
    with pytest.raises(ValueError, match="dense tensor"):
        gemm.linear(x, torch.randn(48, 64).bfloat16(), x_e4m3=given)


@pytest.mark.parametrize("decode_kernel", [False, pytest.param(True, marks=interpreted)])
def test_the_layer_hands_its_norms_rows_to_the_gemms(decode_kernel, monkeypatch):
    """An FP8 model under W8A8 ("on") with adapters on two of three sequences, a prompt step then a decode step:
    each layer's two RMSNorms quantize their output for q/k/v's and gate/up's GEMMs, so that the GEMMs quantize only
    o's and down's inputs (2 of 4 a layer); the logits are the bits of the same model with no rows handed over.
    `decode_kernel`: Triton's interpreter, the "decode" LoRA plan (the GEMMs beside the LoRA kernels, o's and down's
    products expanded by the RMSNorms after them) and the Triton decode GEMM; else the CPU's reference plan and
    prompt GEMM (torch._scaled_mm)."""
    from loraplex.adapters.pool import AdapterPool
    from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
    from loraplex.models import ForwardBatch, KVCache, ModelConfig, SequenceChunk, dummy_model, lora_linear
    from loraplex.ops.gemm import quantize_kernel
    from model_fixtures import hf_config
    config = ModelConfig.from_dict(hf_config("llama-gqa-llama3rope").to_dict())
    dtype = torch.float16 if decode_kernel else torch.bfloat16   # (the interpreter has no bf16 dots)
    model = dummy_model(config, dtype=dtype, seed=5, quantization="fp8")
    pool = AdapterPool(config, num_slots=3, max_rank=8, dtype=dtype, device="cpu")
    for slot in (1, 2):
        pool.write(slot, read_synthetic(synthetic_spec(f"a{slot}", config, 8, seed=slot), dtype, pin=False))
    if decode_kernel:
        model.backend = "triton"
        monkeypatch.setattr(skinny, "SETTING", "on")
    monkeypatch.setattr(fp8, "W8A8", "on")
    from loraplex.models.lora_plan import LoraPlan
    kinds, real_make = [], LoraPlan.make
    monkeypatch.setattr(LoraPlan, "make", lambda *a, **kw: kinds.append(real_make(*a, **kw)) or kinds[-1])
    quantized = []   # the widths of the rows the GEMMs quantize themselves
    real_rows, real_fused = fp8.quantize_rows, quantize_kernel.quantize_rows_fused
    monkeypatch.setattr(fp8, "quantize_rows", lambda t: quantized.append(t.shape[1]) or real_rows(t))
    monkeypatch.setattr(quantize_kernel, "quantize_rows_fused",
                        lambda t, *a: quantized.append(t.shape[1]) or real_fused(t, *a))

    def run() -> list[torch.Tensor]:
        kv = KVCache(config, 8, 16, dtype=dtype)
        tables = [[0, 1], [2, 3], [4, 5]]
        prompts = [[(7 * i + 3 * j) % config.vocab_size for j in range(5 + 3 * i)] for i in range(3)]
        slots = [1, -1, 2]
        steps = [[SequenceChunk(p, 0, t, s) for p, t, s in zip(prompts, tables, slots)],
                 [SequenceChunk([11 * i + 1], len(p), t, s) for i, (p, t, s) in enumerate(zip(prompts, tables, slots))]]
        logits = []
        for chunks in steps:
            batch = ForwardBatch.build(chunks, block_size=16, num_blocks=8, vocab_size=config.vocab_size)
            logits.append(model(batch, kv, pool))
        return logits

    handed = run()
    by_gemms = list(quantized)
    quantized.clear()
    monkeypatch.setattr(lora_linear, "e4m3_input", lambda weight, x_like: None)
    plain = run()
    assert all(torch.equal(a, b) for a, b in zip(handed, plain))
    assert [p.kind for p in kinds] == ["decode" if decode_kernel else "reference"] * 4
    layers, H, I = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    O = config.num_attention_heads * config.head_dim
    assert sorted(quantized) == sorted([H, O, H, I] * 2 * layers)   # q/k/v, o, gate/up, down; two steps
    assert sorted(by_gemms) == sorted([O, I] * 2 * layers)           # o's and down's only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("delta", [None, "product"])
def test_gpu_rms_norm_quantizes_as_the_quantize_launch_does(delta):
    """On the GPU, bf16 at Llama-2-7B's width: the RMSNorm kernels' e4m3 rows are quantize_rows_fused's bits (the
    launch they replace) on the same output."""
    from loraplex.ops.gemm.quantize_kernel import quantize_rows_fused
    gen = torch.Generator().manual_seed(stable_seed("rms-e4m3-gpu", delta))
    T, H = 32, 4096
    x = (torch.randn(T, H, generator=gen) * torch.logspace(-2, 2, T)[:, None]).bfloat16()
    r = torch.randn(T, H, generator=gen).bfloat16()
    w = (1 + 0.3 * torch.randn(H, generator=gen)).bfloat16()
    d = make_product(gen, T, (H,), torch.bfloat16, sizes=x.float().abs().mean(1)) if delta else None
    cuda = lambda t: t.cuda()   # noqa: E731
    d = d and dataclasses.replace(d, part=cuda(d.part), lora_b=tuple(map(cuda, d.lora_b)),
                                  ranks=tuple(map(cuda, d.ranks)), scalings=tuple(map(cuda, d.scalings)),
                                  row_slot=cuda(d.row_slot))
    x, r, w = x.cuda(), r.cuda(), w.cuda()
    e4m3 = QuantizedRows.empty(x)
    out, _ = fused.rms_norm(x, w, 1e-5, residual=r, delta=d, e4m3=e4m3)
    assert torch.equal(out, fused.rms_norm(x, w, 1e-5, residual=r, delta=d)[0])   # (the product: one program a row)
    q, scale = quantize_rows_fused(out)
    assert torch.equal(e4m3.scale, scale) and torch.equal(e4m3.q.view(torch.uint8), q.view(torch.uint8))

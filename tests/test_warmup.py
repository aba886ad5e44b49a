"""models/warmup.py: start-up launches every Triton LoRA kernel variant a step can run (CPU: the interpreter), after
compiling them all at once (ops/launch.py's `compile_ahead`, on a GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from loraplex.adapters import AdapterPool
from loraplex.models import ModelConfig
from model_fixtures import hf_config


def test_lora_kernel_warmup_launches_every_variant_and_changes_nothing(monkeypatch):
    """Every (tile height, K splits, N chunk class) after the GEMMs, the same again into fp32 buffers (the
    LoraDeltas of forwards of up to DECODE_MAX_ROWS rows), and the consumers that expand a projection's product
    (RMSNorm for o and down, SiLU-and-mul for gate/up, RoPE for q/k/v), once per K-split count the shrink can pick
    there, on layers 0-3 and on 1 and 16 rows; the pool's ranks are as before."""
    from loraplex.models.warmup import compile_lora_kernels
    from loraplex.ops import launch
    from loraplex.ops.fused import api as fused
    from loraplex.ops.lora import sgmv
    config = ModelConfig.from_dict(hf_config("llama-gqa-llama3rope").to_dict())
    pool = AdapterPool(config, num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")
    pool.ranks.fill_(3)
    calls = {True: [], False: []}   # inside compile_ahead and after it
    real = sgmv.add_lora
    monkeypatch.setattr(sgmv, "add_lora", lambda *a, **kw: calls[bool(launch._AHEAD)].append(
        ("add_lora", not kw["accumulate"], kw.get("cfg", a[8]).split_k)) or real(*a, **kw))
    for name in ("rms_norm", "silu_and_mul", "apply_rope"):
        op = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _op=op, _name=name, **kw: calls[bool(launch._AHEAD)].append(
            (_name, kw["delta"].part.shape[0])) or _op(*a, **kw))
    launches = compile_lora_kernels(config, pool, torch.float32)
    assert calls[True] == calls[False]   # compiled ahead: the very calls that then launch
    stores = [c[1] for c in calls[False] if c[0] == "add_lora"]
    products = [c for c in calls[False] if c[0] != "add_lora"]
    assert launches == len(stores) + len(products)
    assert len(stores) >= 2 * 2 * 4 * 4 * 2              # tile heights, accumulate or not, layers, projections, splits
    assert sum(stores) == len(stores) // 2               # half of them into fp32 buffers
    splits, calls = {s for _, s in products}, 2 * min(4, config.num_hidden_layers)
    ops_used = ["rms_norm", "silu_and_mul", "apply_rope"]
    assert splits and sorted(products) == sorted((n, s) for n in ops_used for s in splits for _ in range(calls))
    assert bool((pool.ranks == 3).all())


def test_with_compositions_the_consumers_also_take_a_composed_product(monkeypatch):
    """compositions=True: each consumer launch is made again with a composed batch's product (two and three lanes),
    the variants its composed decode forwards take; the pool's ranks are as before."""
    from loraplex.models.warmup import compile_lora_kernels
    from loraplex.ops.fused import api as fused
    from loraplex.ops.lora import sgmv
    config = ModelConfig.from_dict(hf_config("llama-gqa-llama3rope").to_dict())
    pool = AdapterPool(config, num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")
    pool.ranks.fill_(3)
    monkeypatch.setattr(sgmv, "add_lora", lambda *a, **kw: None)   # (the test above runs them; here the consumers)
    lanes = []
    for name in ("rms_norm", "silu_and_mul", "apply_rope"):
        op = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _op=op, _name=name, **kw: lanes.append(
            (_name, kw["delta"].lanes)) or _op(*a, **kw))
    compile_lora_kernels(config, pool, torch.float32, compositions=True)   # (each call twice: compiled, launched)
    for name in ("rms_norm", "silu_and_mul", "apply_rope"):
        assert lanes.count((name, 3)) == lanes.count((name, 2)) == lanes.count((name, 1)) > 0, name
    assert bool((pool.ranks == 3).all())


@pytest.mark.gpu
def test_compile_ahead_compiles_without_launching_and_the_launches_find_the_kernels():
    """Inside `compile_ahead` an add_lora of tiles no other test takes (2 warps) compiles its shrink and expand on
    worker threads and leaves y alone; the same call after it compiles nothing more and adds the LoRA."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from loraplex.ops.launch import compile_ahead
    from loraplex.ops.lora import sgmv
    from lora_cases import make_case, rel_err
    case = make_case(np.random.default_rng(11), seg_lens=[3, 1, 5], popularity="distinct", K=96, Ns=(80, 48), R=16,
                     dtype=torch.bfloat16, device="cuda")
    cfg = sgmv.KernelConfig(split_k=2, n_chunks=3, shrink_block_k=32, expand_block_n=16, shrink_warps=2,
                            expand_warps=2, shrink_stages=2, expand_stages=2)
    kernels = (sgmv._sgmv_shrink_kernel, sgmv._sgmv_expand_kernel)

    def compiled() -> int:
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    y, batch, before = case.y0.clone(), case.batch(), compiled()
    with compile_ahead(workers=2):
        sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, 0, cfg)
    torch.cuda.synchronize()
    assert torch.equal(y, case.y0)
    assert compiled() == before + 2
    sgmv.add_lora(y, case.x, case.lora_a, case.lora_b, batch, case.ranks, case.scalings, 0, cfg)
    assert compiled() == before + 2
    assert rel_err(y, case.oracle(), case.y0) <= 2e-2

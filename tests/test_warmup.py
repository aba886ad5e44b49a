"""models/warmup.py: start-up launches every Triton LoRA kernel variant a step can run (CPU: the interpreter)."""
from __future__ import annotations

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
    from loraplex.ops.fused import api as fused
    from loraplex.ops.lora import sgmv
    config = ModelConfig.from_dict(hf_config("llama-gqa-llama3rope").to_dict())
    pool = AdapterPool(config, num_slots=2, max_rank=4, dtype=torch.float32, device="cpu")
    pool.ranks.fill_(3)
    stores, products = [], []
    real = sgmv.add_lora
    monkeypatch.setattr(sgmv, "add_lora", lambda *a, **kw: stores.append(not kw["accumulate"]) or real(*a, **kw))
    for name in ("rms_norm", "silu_and_mul", "apply_rope"):
        op = getattr(fused, name)
        monkeypatch.setattr(fused, name, lambda *a, _op=op, _name=name, **kw: products.append(
            (_name, kw["delta"].part.shape[0])) or _op(*a, **kw))
    launches = compile_lora_kernels(config, pool, torch.float32)
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
    compile_lora_kernels(config, pool, torch.float32, compositions=True)
    for name in ("rms_norm", "silu_and_mul", "apply_rope"):
        assert lanes.count((name, 3)) == lanes.count((name, 2)) == lanes.count((name, 1)) > 0, name
    assert bool((pool.ranks == 3).all())

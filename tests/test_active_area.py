"""adapters/active_area.py with ops/lora_in_gemm.py: the A rows of the active adapters below each projection's
weight, kept compact as adapters come and go, and one GEMM + the in-GEMM expand giving what add_lora gives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex import ops
from loraplex.adapters.active_area import GROUPS, ActiveArea
from loraplex.adapters.pool import AdapterPool
from loraplex.adapters.synthetic import read_synthetic, synthetic_spec
from loraplex.models import dummy_model
from loraplex.models.config import PROJECTIONS, ModelConfig
from loraplex.ops import LoraBatch
from loraplex.ops.lora.lora_in_gemm import expand_in_gemm

interpreted = pytest.mark.skipif(not ops.triton_interpreted(), reason="needs TRITON_INTERPRET=1 (no CUDA)")
CONFIG = ModelConfig(model_type="llama", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, name_or_path="tiny")
R = 4


def make(capacity: int = 3, num_slots: int = 6, seed: int = 0, config: ModelConfig = CONFIG):
    model = dummy_model(config, dtype=torch.float32, seed=seed)
    pool = AdapterPool(config, num_slots, R, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    for layer in range(CONFIG.num_hidden_layers):
        for proj in PROJECTIONS:
            pool.lora_a[layer][proj].copy_(torch.randn(pool.lora_a[layer][proj].shape, generator=gen))
            pool.lora_b[layer][proj].copy_(torch.randn(pool.lora_b[layer][proj].shape, generator=gen))
    pool.ranks.copy_(torch.randint(0, R + 1, pool.ranks.shape, generator=gen, dtype=torch.int32))
    pool.scalings.copy_(torch.rand(pool.scalings.shape, generator=gen) + 0.5)
    originals = {(i, attr): getattr(layer, attr).detach().clone() for i, layer in enumerate(model.layers)
                 for _, w, b, _ in GROUPS for attr in (w, b) if getattr(layer, attr) is not None}
    return model, pool, ActiveArea(model, pool, capacity), originals


def assert_holds(area: ActiveArea, pool: AdapterPool) -> None:
    """Every active slot's A rows sit at its index, slice by slice, in every layer and group."""
    table = area.slot_active.tolist()
    for slot, index in enumerate(table):
        if index < 0:
            continue
        assert 0 <= index < area.count
        for layer in range(CONFIG.num_hidden_layers):
            for name, _, _, projs in GROUPS:
                w, _ = area.weight(layer, name)
                n = area.groups[layer][name].n_base
                for i, proj in enumerate(projs):
                    row = n + (index * len(projs) + i) * R
                    assert torch.equal(w[row:row + R], pool.lora_a[layer][proj][slot]), (slot, layer, proj)


@pytest.mark.parametrize("biases", [False, True])
def test_the_model_keeps_its_weights_as_views_of_the_extended_ones(biases):
    config = ModelConfig(**{**CONFIG.__dict__, "qkv_bias": biases, "o_bias": biases, "mlp_bias": biases})
    model, pool, area, originals = make(config=config)
    assert len(originals) == (8 if biases else 4) * CONFIG.num_hidden_layers
    for (i, attr), before in originals.items():
        param = getattr(model.layers[i], attr)
        group, weight_attr = next((name, w) for name, w, b, _ in GROUPS if attr in (w, b))
        ext = area.weight(i, group, area.capacity)[0 if attr == weight_attr else 1]
        assert torch.equal(param, before) and param.data_ptr() == ext.data_ptr() and param.is_contiguous()
        if attr != weight_attr:   # the bias below the base columns is zero: the shrink columns get none
            assert not ext[param.numel():].any()
    assert area.count == 0 and (area.slot_active == -1).all()
    assert area.nbytes == sum(g.weight[g.n_base:].numel() * 4 for layer in area.groups for g in layer.values())


def test_update_keeps_the_active_set_compact_and_follows_the_pool():
    _, pool, area, _ = make(capacity=3)
    assert area.update([3, -1, 1, 3]) == 2
    assert_holds(area, pool)
    assert sorted(area.slot_active.tolist()) == [-1, -1, -1, -1, 0, 1]
    assert area.update([1, 5, 0]) == 3            # 3 left: its index went to the last one; 5 and 0 came
    assert area.slot_active[3] == -1
    assert_holds(area, pool)
    copies = []
    place = area._place
    area._place = lambda slot, index: (copies.append(slot), place(slot, index))
    before = area.slot_active.clone()
    area.update([5, 0, 1])                        # the same set: nothing moves, nothing is copied
    assert torch.equal(area.slot_active, before) and copies == []
    area.update([0])                              # each slot copied at most once (0 only if it must move)
    assert area.count == 1 and int(area.slot_active[0]) == 0 and copies in ([], [0])
    assert_holds(area, pool)
    # another adapter is written into slot 0 (the cache reused it): the next update copies it again
    version = pool.versions[0]
    pool.write(0, read_synthetic(synthetic_spec("other", CONFIG, R, seed=9), torch.float32, False))
    assert pool.versions[0] == version + 1
    area.update([0])
    assert_holds(area, pool)
    with pytest.raises(ValueError, match="holds 3"):
        area.update([0, 1, 2, 4])
    with pytest.raises(ValueError, match="slot 6"):
        area.update([6])


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=interpreted)])
def test_one_gemm_and_the_in_gemm_expand_give_what_add_lora_gives(backend):
    """For every layer and group: x @ W_extᵀ over the active adapters, then expand_in_gemm, against the base
    GEMM plus ops.add_lora on the same batch (reference backend): decode rows and a prompt-like segment."""
    _, pool, area, originals = make(capacity=4)
    seg_lens, slots = [1, 1, 6, 1, 1], [2, -1, 5, 2, 0]
    count = area.update(slots)
    batch = LoraBatch.from_lengths(seg_lens, slots, "cpu")
    gen = torch.Generator().manual_seed(7)
    for layer in range(CONFIG.num_hidden_layers):
        for name, attr, _, projs in GROUPS:
            w, _ = area.weight(layer, name, count)
            x = torch.randn(sum(seg_lens), w.shape[1], generator=gen)
            a, b, ranks, scalings = pool.stacks(layer, projs)
            want = ops.add_lora(F.linear(x, originals[(layer, attr)]), x, a, b, batch, ranks, scalings,
                                backend="reference")
            y_ext = F.linear(x, w)
            expand_in_gemm(y_ext, area.groups[layer][name].n_base, b, ranks, scalings, batch, area.slot_active,
                           backend=backend)
            torch.testing.assert_close(y_ext[:, :area.groups[layer][name].n_base], want, rtol=1e-4, atol=1e-4)


def test_random_updates_keep_every_active_slot_in_place():
    """Random sets of slots, now and then a slot rewritten in the pool: after each update the table is
    compact and every active slot's rows are the pool's."""
    _, pool, area, _ = make(capacity=4)
    rng = torch.Generator().manual_seed(3)
    for step in range(60):
        size = int(torch.randint(0, 5, (1,), generator=rng))
        slots = torch.randperm(pool.num_slots, generator=rng)[:size].tolist()
        if step % 7 == 3:   # the cache reloads a slot: the pool's rows change and its version moves
            slot = int(torch.randint(0, pool.num_slots, (1,), generator=rng))
            for layer in range(CONFIG.num_hidden_layers):
                for proj in PROJECTIONS:
                    pool.lora_a[layer][proj][slot].normal_(generator=rng)
            pool.versions[slot] += 1
        assert area.update(slots) == len(slots)
        table = area.slot_active.tolist()
        assert sorted(i for i in table if i >= 0) == list(range(len(slots)))
        assert {s for s, i in enumerate(table) if i >= 0} == set(slots)
        assert_holds(area, pool)

"""The flat-batch forward against transformers + PEFT, which nobody here wrote (CPU, float32).

Each sequence of one mixed batch (prefill chunks over cached prefixes, decodes at different
positions, each with its own adapter or none) must give the logits transformers + PEFT give
for that sequence alone with that adapter. KV blocks of all sequences are interleaved in
the pool, and the cache starts out poisoned with NaN so a read of an unwritten slot shows.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loraplex.adapters import AdapterPool, inspect_peft_adapter, read_peft_adapter
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, load_model
from model_fixtures import VARIANTS, HFOracle, assert_logits_close, make_hf_model
from adapter_fixtures import make_adapter

REL = 1e-4  # the bound for fp32 on the CPU; observed errors are ~1e-6
BLOCK = 8
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name → PEFT LoraConfig: different ranks and targets, one on attention only, one with rsLoRA and a rank pattern.
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp-patterned": dict(r=6, lora_alpha=12, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                          use_rslora=True, rank_pattern={"down_proj": 3}),
}


class Setup:
    def __init__(self, tmp, variant: str) -> None:
        self.variant = variant
        self.base = make_hf_model(tmp / "base", variant, seed=len(variant))
        dirs = {name: make_adapter(self.base, tmp / name, seed=i + 3, **cfg)
                for i, (name, cfg) in enumerate(ADAPTERS.items())}
        self.oracle = HFOracle(self.base, dirs)
        self.model = load_model(self.base, dtype=torch.float32)
        self.config = self.model.config
        self.pool = AdapterPool(self.config, num_slots=4, max_rank=8, dtype=torch.float32, device="cpu")
        self.slots: dict[str | None, int] = {None: -1}
        for slot, (name, folder) in enumerate(dirs.items()):
            adapter = read_peft_adapter(inspect_peft_adapter(folder, self.config, name=name), torch.float32)
            self.pool.write(slot + 1, adapter)  # slot 0 stays unused: slots need not be dense
            self.slots[name] = slot + 1

    def new_cache(self, num_blocks: int = 64, head_major: bool | None = None) -> KVCache:
        kv = KVCache(self.config, num_blocks, BLOCK, dtype=torch.float32, head_major=head_major)
        kv.data.fill_(float("nan"))
        return kv

    def forward(self, kv: KVCache, chunks: list[SequenceChunk], pool=True, graph_room: tuple[int, int] | None = None
                ) -> torch.Tensor:
        """Logits of one forward; with `graph_room` = (sequences, prompt tokens), through a CUDA-graph
        batch of that capacity (`for_graph` + `update_`, padded) instead of a built one."""
        if graph_room is None:
            batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                                       vocab_size=self.config.vocab_size)
        else:
            batch = ForwardBatch.for_graph(graph_room[0], 64, block_size=BLOCK, num_blocks=kv.num_blocks,
                                           vocab_size=self.config.vocab_size, num_adapter_slots=self.pool.num_slots,
                                           device="cpu", max_prompt_tokens=graph_room[1]).update_(chunks)
        logits = self.model(batch, kv, self.pool if pool else None)
        return logits if graph_room is None else logits[:len(batch.logits_seqs)]


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request, tmp_path_factory):
    return Setup(tmp_path_factory.mktemp(request.param), request.param)


def _blocks(rng: random.Random, kv: KVCache, lengths: list[int]) -> list[list[int]]:
    """Block tables for sequences of `lengths`, pages handed out shuffled and round-robin (interleaved)."""
    free = list(range(kv.num_blocks))
    rng.shuffle(free)
    need = [-(-n // BLOCK) for n in lengths]
    tables: list[list[int]] = [[] for _ in lengths]
    while any(len(t) < n for t, n in zip(tables, need)):
        for t, n in zip(tables, need):
            if len(t) < n:
                t.append(free.pop())
    return tables


# (adapter, cached prefix length, new tokens this step): prefills, chunks over a prefix, decodes.
PLAN = [("all-r8", 0, 13), ("attn-r4", 5, 9), (None, 9, 1), ("mlp-patterned", 21, 1), ("all-r8", 0, 3),
        ("attn-r4", 30, 1), (None, 0, 6), ("mlp-patterned", 4, 4)]

# The configurations the Triton tests below run on. Through the Triton kernels what tells the five apart is the
# attention's G (heads per kv head) and sliding window (ops/attention_kernels.py: G, G_PAD, BLOCK_Q and WINDOW are
# constexprs of the prefill kernel, G of the decode one, whose o-shrink epilogue sums over the kv heads), the number
# of kv heads (strides of a head-major cache), biases (HAS_BIAS of ops/skinny_gemm.py and ops/skinny_lora.py;
# ops/stored_lora.py leaves biased projections to the plain path) and widths that are not a multiple of a tile
# (skinny_lora's EVEN_K and SHRINK_EVEN_K). The LoRA kernels and the ops that consume their products
# (sgmv_kernels.py, fused_lora_kernels.py, fused_lora_rms_split.py, rms_shrink.py, silu_shrink.py,
# lora_in_gemm.py) take nothing from the model's shape at these sizes but masks and runtime values (the same rank
# tiles, RoPE's BLOCK_H = 4 heads, one 128-column SiLU block, 64 hidden columns, no K split at K <= 96): one
# configuration runs all of their code. The llama3 and linear RoPE scalings only change inv_freq, computed on the
# host (models/rope.py), so llama-gqa-llama3rope reaches exactly TEXT's code.
#   TEXT:   GQA with G = 2, no window, no bias.
#   WINDOW: G = 4 (one kv head), a window on every layer, intermediate size 80 (not a multiple of 32).
#   BIASED: G = 2 with two kv heads, layer 0 full attention and layer 1 windowed, biased q/k/v, tied embeddings.
#   MHA:    G = 1 (the decode attention's LORA_PREFETCH is on only there), biases on every projection (o's and the
#           MLP's reach the Triton paths only here).
# llama-mha-tied-odd-bias-linear (G = 1, head size 12) never runs there: the Triton attention takes powers of two.
TEXT, WINDOW, BIASED, MHA = "llama-text", "mistral-gqa4-window", "qwen2-bias-tied-window", "llama-mha-bias"


def test_mixed_batch_matches_transformers_peft(setup):
    check_mixed_batch(setup, PLAN)


@pytest.mark.parametrize("backend, graph_room", [("reference", None), ("reference", (8, 96)), ("triton", None)])
def test_lora_inside_the_gemms_matches_too(setup, backend, graph_room, monkeypatch):
    """An ActiveArea attached to the model (adapters/active_area.py), forwards inside `model.lora_in_gemm()`:
    each projection's GEMM also computes the active adapters' shrinks; RoPE expands q/k/v's product from those
    columns (an in-gemm LoraProduct) and ops/lora_in_gemm.py's expand adds the others'. Outside it the usual
    path runs; inside it a batch whose adapters the area does not hold is refused, naming the slots."""
    from loraplex import ops
    from loraplex.adapters.active_area import ActiveArea
    from loraplex.models import llama
    if backend == "triton" and not ops.triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (no CUDA): tests/test_model_gpu.py runs it for real")
    if backend == "triton" and setup.config.head_dim & (setup.config.head_dim - 1):
        pytest.skip("the Triton attention kernels take power-of-two head sizes")
    # One configuration: lora_in_gemm.py's expand and RoPE's IN_GEMM kernel take only the slices and the rank
    # from the model (see TEXT above); WINDOW's attention (G = 4, windowed) runs in test_o_shrink_in_the_attention_
    # kernel_matches_too[WINDOW] and test_lora_inside_the_skinny_gemm_matches_too[WINDOW].
    if backend == "triton" and setup.variant != TEXT:
        pytest.skip("an opt-in path (measured not to pay): one configuration covers its kernels (~21 s here)")
    calls, ropes = [], []
    real = llama.expand_in_gemm
    monkeypatch.setattr(llama, "expand_in_gemm", lambda *a, **kw: calls.append(kw["backend"]) or real(*a, **kw))
    real_rope = llama.apply_rope
    monkeypatch.setattr(llama, "apply_rope", lambda *a, **kw: ropes.append(kw["delta"]) or real_rope(*a, **kw))
    used = sorted({setup.slots[name] for name, _, _ in PLAN if name is not None})
    area = ActiveArea(setup.model, setup.pool, capacity=len(used) + 1)
    setup.model.backend = backend
    setup.model.active_area = area
    try:
        check_mixed_batch(setup, PLAN, graph_room=graph_room)   # outside lora_in_gemm: the usual path
        assert not calls
        area.update(used[:-1])
        with setup.model.lora_in_gemm(), pytest.raises(ValueError, match=r"does not hold the batch's adapters"):
            check_mixed_batch(setup, PLAN, graph_room=graph_room)
        assert area.update(reversed(used)) == len(used)
        with setup.model.lora_in_gemm(len(used) + 1):   # a wider GEMM than the active adapters need: the same
            check_mixed_batch(setup, PLAN, graph_room=graph_room)
        assert calls and set(calls) == {backend}
        assert len(calls) == 2 * 3 * setup.config.num_hidden_layers   # two forwards, o, gate/up and down
        in_gemm = [d for d in ropes if d is not None and d.slot_active is not None]
        assert len(in_gemm) == 2 * setup.config.num_hidden_layers and all(d.active_count == 4 for d in in_gemm)
        with setup.model.lora_in_gemm(len(used) - 1), pytest.raises(ValueError, match="at indices below"):
            check_mixed_batch(setup, PLAN, graph_room=graph_room)
        with pytest.raises(ValueError, match=r"count must be an int in \[1, 4\]"):
            with setup.model.lora_in_gemm(5):
                pass
    finally:
        setup.model.backend = None
        setup.model.active_area = None
    with pytest.raises(ValueError, match="needs an active_area"):
        with setup.model.lora_in_gemm():
            pass


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_head_major_kv_cache_matches_too(setup, backend):
    """KVCache(head_major=True): each kv head's tokens of a block contiguous; the ops follow the strides."""
    from loraplex import ops
    if backend == "triton" and not ops.triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (no CUDA): tests/test_model_gpu.py runs the kernels for real")
    if backend == "triton" and setup.config.head_dim & (setup.config.head_dim - 1):
        pytest.skip("the Triton attention kernels take power-of-two head sizes")
    # Triton on BIASED alone: its two kv heads make the head-major strides differ from token-major ones (WINDOW's
    # one kv head reads the same addresses either way), with G = 2 as TEXT and llama-gqa-llama3rope, and a
    # windowed layer beside a full one. G = 4 on the token-major cache: test_o_shrink_..._matches_too[WINDOW].
    if backend == "triton" and setup.variant != BIASED:
        pytest.skip("one configuration covers the head-major cache through the kernels (~9 s here)")
    setup.model.backend = backend
    try:
        check_mixed_batch(setup, PLAN, head_major=True)
    finally:
        setup.model.backend = None


ALL_FOUR = ("q_proj", "o_proj", "gate_proj", "down_proj")
QKV_O_DOWN = ("q_proj", "o_proj", "down_proj")


@pytest.mark.parametrize("overlap_mode, fused_projs, rms_split, down_in_silu, boundaries", [
    ("full", None, 0, False, False), ("fused", None, None, False, False), ("full", None, 0, True, False),
    ("fused", None, 0, True, False), ("fused", ALL_FOUR, 0, True, False), ("fused", ALL_FOUR, 16, False, False),
    ("off", None, 0, True, False), ("fused", QKV_O_DOWN, 16, False, True), ("fused", ALL_FOUR, 32, False, True),
    ("fused", QKV_O_DOWN, 16, True, True)])
def test_triton_kernels_in_the_interpreter_match_too(setup, overlap_mode, fused_projs, rms_split, down_in_silu,
                                                     boundaries, monkeypatch):
    """The same through every Triton kernel (LoRA, attention, fused ops) run by Triton's CPU interpreter:
    with each LoRA product left for the next op to add (ops/overlap.py's "full"), left unexpanded for the
    next op to expand ("fused", the default for forwards of up to MAX_ROWS rows: q/k/v's product, the
    others as "full"; or every projection's, RMSNorm's rows whole or over programs of `rms_split` columns;
    None: the defaults, q/k/v's, o's and down's products, fused_lora_kernels.RMS_SPLIT columns),
    and added after each GEMM. `down_in_silu`: models/llama.DOWN_SHRINK_IN_SILU (down's shrink inside
    SiLU-and-mul where the products are left to the next op and down is not a fused projection).
    `boundaries`: models/llama.FUSED_BOUNDARIES (the split RMSNorm after o and down also computing the next
    projection's shrink, ops/rms_shrink.py)."""
    # Each case on the configurations that reach different code (see TEXT above): the paths off by default on
    # TEXT; the defaults ("full", and "fused" with its projections and RMS_SPLIT) on BIASED, whose biased q/k/v
    # GEMMs feed RoPE's delta and product, and MHA (G = 1; biased o, gate/up and down before the ops that take
    # their products). WINDOW's attention (G = 4) runs in test_o_shrink_in_the_attention_kernel_matches_too and
    # the tests of the opt-in paths.
    off_by_default = bool(down_in_silu or boundaries or rms_split or fused_projs)
    if setup.variant not in ((TEXT,) if off_by_default else (BIASED, MHA)):
        pytest.skip("the configurations named above cover each case (each run takes ~10 s here)")
    from loraplex.models import llama
    from loraplex.ops.lora import overlap
    from loraplex.ops.fused import rms_shrink
    monkeypatch.setattr(llama, "DOWN_SHRINK_IN_SILU", down_in_silu)
    monkeypatch.setattr(llama, "FUSED_BOUNDARIES", boundaries)
    boundary_calls = []
    real_boundary = rms_shrink.rms_norm_shrink
    monkeypatch.setattr(llama, "rms_norm_shrink", lambda *a, **kw: boundary_calls.append(kw["block"])
                        or real_boundary(*a, **kw))
    if setup.config.head_dim & (setup.config.head_dim - 1):
        pytest.skip("the Triton attention kernels take power-of-two head sizes")
    monkeypatch.setenv("LORAPLEX_LORA_OVERLAP", overlap_mode)
    if fused_projs:
        monkeypatch.setattr(overlap, "FUSED_PROJECTIONS", frozenset(fused_projs))
    from loraplex.ops.fused import lora_kernels as fused_lora_kernels
    from loraplex.ops.fused import rms_split as fused_lora_rms_split
    if rms_split is None:
        rms_split = fused_lora_kernels.RMS_SPLIT
    monkeypatch.setattr(fused_lora_kernels, "RMS_SPLIT", rms_split)
    split_calls = []
    real_split = fused_lora_rms_split.rms_norm
    monkeypatch.setattr(fused_lora_rms_split, "rms_norm", lambda *a: split_calls.append(a[7]) or real_split(*a))
    calls = {"full": [], "fused": [], "expand": []}
    for mode, name in (("full", "linear_with_lora_delta"), ("fused", "linear_with_lora_product"),
                       ("expand", "linear_with_lora_expand")):
        real = getattr(overlap, name)
        monkeypatch.setattr(overlap, name, lambda *a, _real=real, _log=calls[mode], **kw: _log.append(kw["side"])
                            or _real(*a, **kw))
    setup.model.backend = "triton"
    try:
        # prompt chunks of 4, 3 and 17 tokens (the 17 two 16-row LoRA tiles of one adapter), then a mixed forward:
        # a prompt, a chunk over a cached prefix without an adapter, two decodes. (attn-r4's prefix was 9 tokens and
        # all-r8's prompt 11: the same tiles and paths, a fifth more rows for the interpreter to walk.)
        check_mixed_batch(setup, [("all-r8", 0, 6), ("attn-r4", 4, 1), (None, 3, 5), ("mlp-patterned", 17, 1)],
                          graph_room=(8, 32) if overlap_mode == "off" else None)   # ("off": > MAX_ROWS rows)
    finally:
        setup.model.backend = None
    # both forwards (24 and 13 rows) have prompts in them: every fused projection's product is left
    want_fused = set(fused_projs or overlap.FUSED_PROJECTIONS) if overlap_mode == "fused" else set()
    want, boundary_count = _expected_lora_calls(overlap_mode, fused_projs or overlap.FUSED_PROJECTIONS, down_in_silu,
                                                boundaries, setup.config.num_hidden_layers)
    assert {k: len(v) for k, v in calls.items()} == {k: 2 * n for k, n in want.items()}   # two forwards
    assert boundary_calls == [rms_split] * 2 * boundary_count
    assert not any(calls["full"] + calls["fused"] + calls["expand"])   # the side stream only while capturing
    assert (len(split_calls) > 0) == bool(rms_split and {"o_proj", "down_proj"} & want_fused)
    assert set(split_calls) <= {rms_split}


@pytest.mark.parametrize("order", ["after", "side", "before"])
def test_fused_shrinks_in_each_order_match_too(setup, order, monkeypatch):
    """ops/overlap.py's LORAPLEX_LORA_SHRINK_ORDER: the fused projections' shrink after the GEMM (the default; its
    kernel's AFTER_GEMM variant: with PDL it releases the consumer first and waits last, nothing in the
    interpreter), beside it ("side": before it in eager forwards) or before it; the same products as
    transformers + PEFT through the interpreter."""
    if setup.variant != BIASED:
        pytest.skip("one configuration (biased q/k/v before RoPE's product) covers the order (~10 s a run here)")
    from loraplex.ops.lora import overlap
    from loraplex.ops.lora import sgmv
    monkeypatch.setattr(overlap, "SHRINK_ORDER", order)
    # "after" needs PDL and the Triton GEMM (overlap.shrink_order; neither in the interpreter): its path all the same
    monkeypatch.setattr(overlap, "_after_applies", lambda x, weight: True)
    monkeypatch.setenv("LORAPLEX_LORA_OVERLAP", "fused")
    afters, products = [], []
    real, real_product = sgmv.shrink_into, overlap.linear_with_lora_product
    monkeypatch.setattr(sgmv, "shrink_into", lambda *a, **kw: afters.append(kw.get("after_gemm", False))
                        or real(*a, **kw))
    monkeypatch.setattr(overlap, "linear_with_lora_product", lambda *a, **kw: products.append(1)
                        or real_product(*a, **kw))
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, [("all-r8", 0, 6), ("attn-r4", 4, 1), (None, 3, 5)])
    finally:
        setup.model.backend = None
    # every fused projection's shrink (and only those) after its GEMM
    assert products and afters.count(True) == (len(products) if order == "after" else 0), afters


@pytest.mark.parametrize("store_first", [True, False])
def test_lora_stored_before_the_gemm_matches_too(setup, store_first, monkeypatch):
    """Eager forwards of more than 32 rows, every row with an adapter, through the interpreter: with
    KernelConfig.store_first each biasless projection's expand stores its product and the GEMM adds to it
    (ops/stored_lora.py); without it the expand adds after the GEMM. Both forwards (36 and 35 rows) take it."""
    from loraplex import ops
    from loraplex.models import llama
    from loraplex.ops.lora import sgmv
    if not ops.triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (no CUDA): tests/test_model_gpu.py runs it for real")
    # store_first on TEXT (q/k/v's three slices stored too) and BIASED (biased q/k/v left to the plain path);
    # without it (the plain path, "direct") on TEXT alone (BIASED's biased "direct" path: the head-major test's);
    # WINDOW's attention runs in the o-shrink test.
    if setup.variant not in ((TEXT, BIASED) if store_first else (TEXT,)):
        pytest.skip("two configurations cover it, one with biased q/k/v (~7 s each here)")
    for block_m in (16, 64):
        monkeypatch.setitem(sgmv.CONFIGS, block_m, dataclasses.replace(sgmv.CONFIGS[block_m],
                                                                        store_first=store_first))
    calls = []
    real = llama.linear_with_lora_stored
    monkeypatch.setattr(llama, "linear_with_lora_stored", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, [("all-r8", 0, 14), ("attn-r4", 9, 12), ("mlp-patterned", 21, 1),
                                  ("all-r8", 6, 8)])
    finally:
        setup.model.backend = None
    layer = setup.model.layers[0]
    biasless = sum(b is None for b in (layer.qkv_bias, layer.o_bias, layer.gate_up_bias, layer.down_bias))
    per_forward = biasless * setup.config.num_hidden_layers
    assert calls == ([36] * per_forward + [35] * per_forward if store_first else [])
    assert not store_first or per_forward > 0


@pytest.mark.parametrize("plan", ["every-row-an-adapter", "rows-without"])
def test_gate_up_product_expanded_by_silu_tiles_matches_too(setup, plan, monkeypatch):
    """LORAPLEX_LORA_SILU_TILES=on, eager forwards of more than 32 rows through the interpreter: gate/up's GEMM and
    shrink only, SiLU-and-mul expanding the product over the batch's work tiles (ops/silu_lora_tiles.py); with
    rows without an adapter its row-block programs run too."""
    from loraplex import ops
    from loraplex.ops.fused import silu_lora_tiles
    from loraplex.ops.fused import silu_lora_tiles_kernels
    if not ops.triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (no CUDA): tests/test_model_gpu.py runs it for real")
    # TEXT, and WINDOW's intermediate size 80 (not a multiple of the 64-column block); biases do not reach it
    if setup.variant not in (TEXT, WINDOW) or (setup.variant == WINDOW and plan == "rows-without"):
        pytest.skip("two configurations cover it (~7 s each here)")
    monkeypatch.setattr(silu_lora_tiles, "SETTING", "on")
    calls = []
    real = silu_lora_tiles_kernels.silu_and_mul
    monkeypatch.setattr(silu_lora_tiles_kernels, "silu_and_mul",
                        lambda gu, out, lora: calls.append(lora.tiles.all_rows_have_adapters) or real(gu, out, lora))
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, PLAN if plan == "rows-without" else [
            ("all-r8", 0, 14), ("attn-r4", 9, 12), ("mlp-patterned", 21, 1), ("all-r8", 6, 8)])
    finally:
        setup.model.backend = None
    assert calls == [plan != "rows-without"] * 2 * setup.config.num_hidden_layers   # two forwards


def _fused_path_calls(monkeypatch) -> dict[str, list[int]]:
    """"fused" on, and the rows of each call of its "full" (linear_with_lora_delta) and "fused"
    (linear_with_lora_product) paths, in call order."""
    from loraplex.ops.lora import overlap
    monkeypatch.setenv("LORAPLEX_LORA_OVERLAP", "fused")
    calls = {"full": [], "fused": []}
    for mode, name in (("full", "linear_with_lora_delta"), ("fused", "linear_with_lora_product")):
        real = getattr(overlap, name)
        monkeypatch.setattr(overlap, name, lambda *a, _real=real, _log=calls[mode], **kw: _log.append(a[0].shape[0])
                            or _real(*a, **kw))
    return calls


def test_decode_forwards_of_few_rows_leave_only_the_qkv_product(setup, monkeypatch):
    """"fused" in a decode forward of fewer than overlap.FUSED_MIN_ROWS rows (here 3): only q/k/v's product goes
    to its consumer (RoPE), o's, gate/up's and down's take "full"'s way; a forward with prompts leaves every
    fused projection's, however few its rows (here 4). The logits still match transformers + PEFT."""
    if setup.variant != TEXT:
        pytest.skip("one configuration covers it (each run takes ~10 s here)")
    from loraplex.ops.lora import overlap
    assert overlap.fused_projections(overlap.FUSED_MIN_ROWS - 1, decode=True) == {"q_proj"}
    assert overlap.fused_projections(overlap.FUSED_MIN_ROWS, decode=True) >= overlap.FUSED_PROJECTIONS > {"q_proj"}
    assert overlap.fused_projections(1, decode=False) == overlap.FUSED_PROJECTIONS
    calls = _fused_path_calls(monkeypatch)
    setup.model.backend = "triton"
    assert overlap.FUSED_MIN_ROWS > 4
    try:   # prompt chunks of 2, 1 and 1 tokens, then one decode row each
        check_mixed_batch(setup, [("all-r8", 2, 1), ("attn-r4", 1, 1), (None, 1, 1)])
    finally:
        setup.model.backend = None
    layers = setup.config.num_hidden_layers
    assert calls["fused"] == [4] * 3 * layers + [3] * layers          # q, o, down; then q alone
    assert calls["full"] == [4] * layers + [3] * 3 * layers           # gate/up; then o, gate/up, down


def test_decode_forwards_of_up_to_32_rows_leave_gate_up_to_silu(setup, monkeypatch):
    """"fused" in a decode forward of FUSED_MIN_ROWS to DECODE_EXTRA_MAX_ROWS rows (here 6): gate/up's product
    goes to SiLU-and-mul too (overlap.DECODE_EXTRA_FUSED), while a forward with prompts keeps its expand. The
    logits still match transformers + PEFT."""
    if setup.variant != TEXT:
        pytest.skip("one configuration covers it (each run takes ~10 s here)")
    from loraplex.ops.lora import overlap
    assert overlap.DECODE_EXTRA_FUSED == {"gate_proj"} and overlap.DECODE_EXTRA_MAX_ROWS == 32
    assert overlap.fused_projections(6, decode=True) == overlap.FUSED_PROJECTIONS | {"gate_proj"}
    assert overlap.fused_projections(32, decode=True) == overlap.FUSED_PROJECTIONS | {"gate_proj"}
    assert overlap.fused_projections(33, decode=True) == overlap.FUSED_PROJECTIONS
    assert overlap.fused_projections(6, decode=False) == overlap.FUSED_PROJECTIONS
    calls = _fused_path_calls(monkeypatch)
    setup.model.backend = "triton"
    try:   # prompt chunks of 9 tokens in all, then one decode row each (gate/up's LoRA in four of them)
        check_mixed_batch(setup, [("all-r8", 3, 1), ("mlp-patterned", 2, 1), (None, 1, 1), ("attn-r4", 1, 1),
                                  ("all-r8", 1, 1), ("mlp-patterned", 1, 1)])
    finally:
        setup.model.backend = None
    layers = setup.config.num_hidden_layers
    assert calls["fused"] == [9] * 3 * layers + [6] * 4 * layers      # q, o, down; then q, o, gate/up, down
    assert calls["full"] == [9] * layers                               # gate/up's expand with the prompts alone


def test_skinny_gemm_projections_match_too(setup, monkeypatch):
    """LORAPLEX_SKINNY_GEMM=on (ops/skinny_gemm.py): every projection (and the LM head) of a forward of at most
    DECODE_MAX_ROWS rows runs the Triton GEMM (here in the interpreter, with the LoRA kernels and the "fused"
    path), a mixed forward of 9 rows and a decode forward of 6; the logits still match transformers + PEFT."""
    # BIASED alone: its q/k/v take the kernel's HAS_BIAS path, its other projections and tied LM head the
    # biasless one; K <= 96 < BLOCK_K everywhere (pick_config's 256), so no configuration reaches EVEN_N and EVEN_K.
    if setup.variant != BIASED:
        pytest.skip("an opt-in path: one configuration covers it (~4 s here)")
    if setup.config.head_dim & (setup.config.head_dim - 1):
        pytest.skip("the Triton attention kernels take power-of-two head sizes")
    from loraplex.ops.gemm import skinny as skinny_gemm
    monkeypatch.setattr(skinny_gemm, "SETTING", "on")
    rows = []
    real = skinny_gemm.skinny_linear
    monkeypatch.setattr(skinny_gemm, "skinny_linear", lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, **kw))
    calls = _fused_path_calls(monkeypatch)
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, [("all-r8", 3, 1), ("mlp-patterned", 2, 1), (None, 1, 1), ("attn-r4", 1, 1),
                                  ("all-r8", 1, 1), ("mlp-patterned", 1, 1)])
    finally:
        setup.model.backend = None
    layers = setup.config.num_hidden_layers
    # q/k/v, o, gate/up and down of both forwards, and the LM head on the rows that get logits (3, then 6)
    assert rows == [9] * 4 * layers + [3] + [6] * 4 * layers + [6]
    assert len(calls["fused"]) == 7 * layers             # and the LoRA took the "fused" path beside them


def test_lora_inside_the_skinny_gemm_matches_too(setup, monkeypatch):
    """LORAPLEX_SKINNY_LORA=on (ops/skinny_lora.py): each projection of a forward of at most 32 rows runs its GEMM,
    shrink and expand in one launch (in the interpreter; 16-column tiles, so that the tiny models' slices fit them),
    a mixed forward of 9 rows and a decode forward of 6, with adapters of different ranks and targets and a row
    without one; one configuration has q/k/v biases. The logits still match transformers + PEFT."""
    from loraplex.ops.gemm import skinny as skinny_gemm
    from loraplex.ops.gemm import skinny_lora
    from loraplex.ops.gemm.skinny import SkinnyConfig
    # BIASED: HAS_BIAS (q/k/v) and the biasless projections, K a multiple of 32; WINDOW: down's K = 80, which is
    # not (EVEN_K and SHRINK_EVEN_K false). TEXT reaches nothing else (BIASED's shapes without the biases).
    if setup.variant not in (BIASED, WINDOW):
        pytest.skip("an opt-in path: two configurations cover it (each run takes ~5-10 s here)")
    if setup.config.head_dim & (setup.config.head_dim - 1):
        pytest.skip("the Triton attention kernels take power-of-two head sizes")
    monkeypatch.setattr(skinny_gemm, "SETTING", "on")
    monkeypatch.setattr(skinny_lora, "SETTING", "on")
    monkeypatch.setattr(skinny_lora, "config_for", lambda w: SkinnyConfig(block_n=16, block_k=32, stages=1))
    rows = []
    real = skinny_lora.skinny_lora_linear
    monkeypatch.setattr(skinny_lora, "skinny_lora_linear",
                        lambda x, *a, **kw: rows.append(x.shape[0]) or real(x, *a, config=skinny_lora.config_for(x),
                                                                             **kw))
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, [("all-r8", 3, 1), ("mlp-patterned", 2, 1), (None, 1, 1), ("attn-r4", 1, 1),
                                  ("all-r8", 1, 1), ("mlp-patterned", 1, 1)])
    finally:
        setup.model.backend = None
    layers = setup.config.num_hidden_layers
    assert rows == [9] * 4 * layers + [6] * 4 * layers   # q/k/v, o, gate/up and down of both forwards


def test_eager_decode_steps_choose_the_fused_projections_their_graph_would():
    """A decode step of n sequences replays the graph of the smallest bucket that holds it (engine/cuda_graphs.py):
    eager, it leaves the same products to their consumers as that graph does (so the two compute alike)."""
    from loraplex.engine.cuda_graphs import graph_buckets
    from loraplex.ops.lora import overlap
    for max_batch in range(1, 70):
        buckets = graph_buckets(max_batch)
        for n in range(1, max_batch + 1):
            bucket = next(b for b in buckets if b >= n)
            assert overlap.fused_projections(n, decode=True) == overlap.fused_projections(bucket, decode=True), \
                (max_batch, n, bucket)


@pytest.mark.parametrize("overlap_mode", ["full", "fused"])
def test_o_shrink_in_the_attention_kernel_matches_too(setup, overlap_mode, monkeypatch):
    """models/llama.O_SHRINK_IN_ATTENTION through the interpreter: the second forward is a decode step (every
    sequence one row), whose attention kernel computes o's shrink (ops/attention_shrink.py) and o's GEMM has
    only the expand beside it; the first (prompt chunks) takes the plain path."""
    from loraplex.models import llama
    from loraplex.ops.attention import attention_shrink
    from loraplex.ops.lora import overlap
    if setup.config.head_dim & (setup.config.head_dim - 1):
        pytest.skip("the Triton attention kernels take power-of-two head sizes")
    # Each mode on one configuration: at 4 decode rows o is not a fused projection in either (so both take the
    # same o-shrink path); they differ in q/k/v's product for RoPE, test_triton_kernels_..._match_too's. BIASED: G = 2
    # over two kv heads, a full and a windowed layer (so TEXT's and llama-gqa-llama3rope's path too); WINDOW: G = 4;
    # MHA: G = 1, where the kernel loads A a step ahead (attention_kernels' LORA_PREFETCH).
    if setup.variant not in {"full": (BIASED, MHA), "fused": (WINDOW,)}[overlap_mode]:
        pytest.skip("the configurations named above cover each mode (~5 s each here)")
    monkeypatch.setattr(llama, "O_SHRINK_IN_ATTENTION", True)
    monkeypatch.setenv("LORAPLEX_LORA_OVERLAP", overlap_mode)
    parts, expands = [], []
    def attention(*a, **kw):
        got = attention_shrink.decode_attention_shrink(*a, **kw)
        parts.append(got[1])
        return got

    monkeypatch.setattr(llama, "decode_attention_shrink", attention)
    real_expand = overlap.linear_with_lora_expand
    monkeypatch.setattr(overlap, "linear_with_lora_expand", lambda *a, **kw: expands.append(a[3])
                        or real_expand(*a, **kw))
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, [("all-r8", 9, 1), ("attn-r4", 9, 1), (None, 3, 1), ("mlp-patterned", 17, 1)])
    finally:
        setup.model.backend = None
    layers, kv_heads = setup.config.num_hidden_layers, setup.config.num_key_value_heads
    assert len(parts) == layers and all(p is not None and p.shape[0] == kv_heads for p in parts)
    assert len(expands) == layers and all(e.shape[0] == kv_heads for e in expands)


def _expected_lora_calls(mode: str, fused_projs, down_in_silu: bool, boundaries: bool,
                         layers: int) -> tuple[dict[str, int], int]:
    """Per forward, models/llama.py's calls of overlap's "full" (linear_with_lora_delta), "fused"
    (linear_with_lora_product) and "expand" (linear_with_lora_expand) paths, and of rms_norm_shrink."""
    calls = {"full": 0, "fused": 0, "expand": 0}
    if mode == "off":
        return calls, 0
    fp = set(fused_projs) if mode == "fused" else set()

    def plain(proj: str) -> None:
        calls["fused" if proj in fp else "full"] += 1

    boundary = 0
    for layer in range(layers):
        if boundaries and layer > 0 and "down_proj" in fp:   # the norm after the last down computes q/k/v's shrink
            boundary += 1
            calls["expand"] += "q_proj" not in fp
        else:
            plain("q_proj")
        plain("o_proj")
        if boundaries and "o_proj" in fp:                     # the norm after o computes gate/up's shrink
            boundary += 1
            calls["expand"] += "gate_proj" not in fp
        else:
            plain("gate_proj")
        if down_in_silu and "gate_proj" not in fp:             # down's shrink in SiLU-and-mul
            calls["expand"] += "down_proj" not in fp
        else:
            plain("down_proj")
    return calls, boundary


def test_mixed_graph_batch_matches_transformers_peft(setup):
    """A mixed step through a graph batch (engine/cuda_graphs.py's mixed graphs): padded rows and sequences
    change nothing."""
    check_mixed_batch(setup, PLAN, graph_room=(12, 72))


def check_mixed_batch(setup, plan, graph_room: tuple[int, int] | None = None, head_major: bool | None = None):
    rng = random.Random(7)
    V = setup.config.vocab_size
    tokens = [[rng.randrange(V) for _ in range(c + n)] for _, c, n in plan]
    kv = setup.new_cache(head_major=head_major)
    tables = _blocks(rng, kv, [len(t) for t in tokens])
    # Step 1: the cached prefixes, as one batch of prompt chunks (only some want logits).
    with_prefix = [i for i, (_, c, _) in enumerate(plan) if c > 0]
    asked = [i for k, i in enumerate(with_prefix) if k % 2 == 0]
    first = [SequenceChunk(tokens[i][:plan[i][1]], 0, tables[i], setup.slots[plan[i][0]], needs_logits=i in asked)
             for i in with_prefix]
    logits1 = setup.forward(kv, first, graph_room=graph_room)
    assert logits1.shape == (len(asked), V)
    for row, i in enumerate(asked):
        expect = setup.oracle.logits(tokens[i][:plan[i][1]], plan[i][0])[-1]
        assert_logits_close(logits1[row], expect, REL, f"prefix of sequence {i}")
    # Step 2: everything together, each sequence continuing from its cached prefix.
    second = [SequenceChunk(t[c:], c, tab, setup.slots[a]) for (a, c, _), t, tab in zip(plan, tokens, tables)]
    logits2 = setup.forward(kv, second, graph_room=graph_room)
    assert logits2.shape == (len(plan), V)
    for i, (adapter, _, _) in enumerate(plan):
        assert_logits_close(logits2[i], setup.oracle.logits(tokens[i], adapter)[-1], REL,
                            f"sequence {i} (adapter {adapter})")


def test_adapters_change_the_logits(setup):
    """Guard against a test that cannot fail: each adapter moves the logits well beyond the tolerance."""
    rng = random.Random(3)
    tokens = [rng.randrange(setup.config.vocab_size) for _ in range(10)]
    base = setup.oracle.logits(tokens, None)[-1]
    for name in ADAPTERS:
        diff = (setup.oracle.logits(tokens, name)[-1] - base).abs().max().item()
        assert diff > 100 * REL * base.abs().max().item(), name


@pytest.mark.parametrize("adapter", [None, "all-r8"])
def test_chunked_prefill_then_decode_matches_one_prefill(setup, adapter):
    rng = random.Random(11)
    tokens = [rng.randrange(setup.config.vocab_size) for _ in range(16)]
    kv_full, kv_chunked = setup.new_cache(), setup.new_cache()
    table = _blocks(rng, kv_full, [len(tokens)])[0]
    slot = setup.slots[adapter]
    full = setup.forward(kv_full, [SequenceChunk(tokens[:12], 0, table, slot)])
    pos, chunked = 0, None
    for size in (5, 3, 4):  # three prompt chunks; only the last asks for logits
        chunked = setup.forward(kv_chunked, [SequenceChunk(tokens[pos:pos + size], pos, table, slot,
                                                           needs_logits=pos + size == 12)])
        pos += size
    assert_logits_close(chunked[0], full[0], 1e-5, "chunked prefill vs one prefill")
    expect = setup.oracle.logits(tokens, adapter)
    assert_logits_close(full[0], expect[11], REL, "prefill")
    for step in range(12, 16):  # decodes, each feeding the next given token
        for kv in (kv_full, kv_chunked):
            out = setup.forward(kv, [SequenceChunk([tokens[step]], step, table, slot)])
            assert_logits_close(out[0], expect[step], REL, f"decode at position {step}")


def test_graph_batch_gives_the_same_logits_after_update(setup):
    """A `for_graph` decode batch, rewritten with `update_`, computes what a freshly built one does."""
    rng = random.Random(9)
    kv = setup.new_cache()
    lengths = [12, 30, 5]
    tables = _blocks(rng, kv, lengths)
    tokens = [[rng.randrange(setup.config.vocab_size) for _ in range(n)] for n in lengths]
    adapters = ["all-r8", None, "mlp-patterned"]
    setup.forward(kv, [SequenceChunk(t[:-1], 0, tab, setup.slots[a], needs_logits=False)
                       for t, tab, a in zip(tokens, tables, adapters)])
    graph = ForwardBatch.for_graph(5, 40, block_size=BLOCK, num_blocks=kv.num_blocks,
                                   vocab_size=setup.config.vocab_size, num_adapter_slots=setup.pool.num_slots,
                                   device="cpu")
    chunks = [SequenceChunk(t[-1:], len(t) - 1, tab, setup.slots[a]) for t, tab, a in zip(tokens, tables, adapters)]
    out = setup.model(graph.update_(chunks), kv, setup.pool)
    assert out.shape == (5, setup.config.vocab_size)
    for i, (t, a) in enumerate(zip(tokens, adapters)):
        assert_logits_close(out[i], setup.oracle.logits(t, a)[-1], REL, f"graph batch sequence {i}")


def test_batch_for_another_cache_or_model_is_refused(setup):
    kv = setup.new_cache(16)
    chunk = [SequenceChunk([1, 2], 0, [3])]
    for kwargs, message in ((dict(block_size=16, num_blocks=16), "built for 16 KV blocks of 16 tokens"),
                            (dict(block_size=BLOCK, num_blocks=32), "built for 32 KV blocks of 8 tokens"),
                            (dict(block_size=BLOCK, num_blocks=16, vocab_size=10), "vocabulary of 10")):
        kwargs.setdefault("vocab_size", setup.config.vocab_size)
        batch = ForwardBatch.build(chunk, **kwargs)
        with pytest.raises(ValueError, match=message):
            setup.model(batch, kv, setup.pool)
    batch = ForwardBatch.build([SequenceChunk([1], 0, [3], adapter_slot=7)], block_size=BLOCK, num_blocks=16,
                               vocab_size=setup.config.vocab_size)
    with pytest.raises(ValueError, match="uses adapter slot 7; the pool has 4"):
        setup.model(batch, kv, setup.pool)


def test_no_pool_is_the_base_model(setup):
    rng = random.Random(5)
    tokens = [rng.randrange(setup.config.vocab_size) for _ in range(9)]
    kv = setup.new_cache()
    table = _blocks(rng, kv, [9])[0]
    without = setup.forward(kv, [SequenceChunk(tokens, 0, table, -1)], pool=False)
    assert_logits_close(without[0], setup.oracle.logits(tokens, None)[-1], REL, "no pool")

"""The flat-batch forward against transformers + PEFT, which nobody here wrote (CPU, float32).

Each sequence of one mixed batch (prefill chunks over cached prefixes, decodes at different
positions, each with its own adapter or none) must give the logits transformers + PEFT give
for that sequence alone with that adapter. KV blocks of all sequences are interleaved in
the pool, and the cache starts out poisoned with NaN so a read of an unwritten slot shows.
"""
from __future__ import annotations

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

    def new_cache(self, num_blocks: int = 64) -> KVCache:
        kv = KVCache(self.config, num_blocks, BLOCK, dtype=torch.float32)
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
# attention's G (heads per kv head) and sliding window (ops/attention/kernels.py: G, G_PAD, BLOCK_Q and WINDOW are
# constexprs of the prefill kernel, G of the decode one), the number of kv heads and
# biases (HAS_BIAS of ops/gemm/skinny.py). The LoRA kernels and the ops that consume their products (ops/lora/
# shrink_kernels.py and expand_kernels.py, ops/fused/lora_kernels.py and rms_split.py) take nothing from the
# model's shape at these sizes but masks and runtime values (the same rank tiles, RoPE's BLOCK_H = 4 heads, one 128-column SiLU block, 64 hidden
# columns, no K split at K <= 96): one configuration runs all of their code. The llama3 and linear RoPE scalings only
# change inv_freq, computed on the host (models/rope.py), so llama-gqa-llama3rope reaches exactly TEXT's code.
#   TEXT:   GQA with G = 2, no window, no bias.
#   WINDOW: G = 4 (one kv head), a window on every layer, intermediate size 80 (not a multiple of 32).
#   BIASED: G = 2 with two kv heads, layer 0 full attention and layer 1 windowed, biased q/k/v, tied embeddings.
#   MHA:    G = 1, biases on every projection (o's and the MLP's reach the Triton paths only here).
# llama-mha-tied-odd-bias-linear (G = 1, head size 12) never runs there: the Triton attention takes powers of two.
TEXT, WINDOW, BIASED, MHA = "llama-text", "mistral-gqa4-window", "qwen2-bias-tied-window", "llama-mha-bias"


def test_mixed_batch_matches_transformers_peft(setup):
    check_mixed_batch(setup, PLAN)


def _lora_calls(monkeypatch) -> dict[str, list[tuple[int, bool]]]:
    """(rows, side) of each call of the "decode" plan's launchers, in call order: "product" (the consumer expands
    the shrink's product) and "delta" (the expanded product, added by the consumer)."""
    from loraplex.ops.lora import overlap
    calls = {"product": [], "delta": []}
    for kind, name in (("product", "linear_with_lora_product"), ("delta", "linear_with_lora_delta")):
        real = getattr(overlap, name)
        monkeypatch.setattr(overlap, name, lambda *a, _real=real, _log=calls[kind], **kw:
                            _log.append((a[0].shape[0], kw["side"])) or _real(*a, **kw))
    return calls


@pytest.mark.parametrize("kind", ["decode", "tiles"])
def test_triton_kernels_in_the_interpreter_match_too(setup, kind, monkeypatch):
    """The same through every Triton kernel (LoRA, attention, fused ops) run by Triton's CPU interpreter, in the
    LoRA plan's two eager kinds (models/lora_plan.py): "decode" (forwards of at most 32 rows: each projection leaves
    its LoRA for the op after it; q/k/v's, o's and down's products expanded by RoPE and the RMSNorms, gate/up's
    expanded beside its GEMM for SiLU-and-mul to add, as forwards with prompts in them do) and "tiles" (more rows:
    the SGMV kernels add each projection's LoRA after its GEMM)."""
    # "decode" on the configurations that reach different code (see TEXT above): BIASED, whose biased q/k/v GEMMs feed
    # RoPE's product, MHA (G = 1; biased o, gate/up and down before the ops that take their LoRA) and WINDOW (G = 4,
    # a window on every layer); "tiles" on TEXT.
    if setup.variant not in ((BIASED, MHA, WINDOW) if kind == "decode" else (TEXT,)):
        pytest.skip("the configurations named above cover each case (each run takes ~10 s here)")
    if setup.config.head_dim & (setup.config.head_dim - 1):
        pytest.skip("the Triton attention kernels take power-of-two head sizes")
    from loraplex.models.lora_plan import LoraPlan
    calls, kinds = _lora_calls(monkeypatch), []
    real_make = LoraPlan.make
    monkeypatch.setattr(LoraPlan, "make", lambda *a, **kw: kinds.append(real_make(*a, **kw)) or kinds[-1])
    setup.model.backend = "triton"
    try:
        # prompt chunks of 4, 3 and 17 tokens (the 17 two 16-row LoRA tiles of one adapter), then a mixed forward:
        # a prompt, a chunk over a cached prefix without an adapter, two decodes
        check_mixed_batch(setup, [("all-r8", 0, 6), ("attn-r4", 4, 1), (None, 3, 5), ("mlp-patterned", 17, 1)],
                          graph_room=(8, 32) if kind == "tiles" else None)   # a 40-row graph batch: "tiles"
    finally:
        setup.model.backend = None
    assert [p.kind for p in kinds] == [kind, kind]
    layers = setup.config.num_hidden_layers
    if kind == "tiles":
        assert calls == {"product": [], "delta": []}
        return
    # both forwards (24 and 13 rows) have prompts in them: q/k/v's, o's and down's products, gate/up's delta; the
    # side stream only while capturing
    assert calls["product"] == [(24, False)] * 3 * layers + [(13, False)] * 3 * layers
    assert calls["delta"] == [(24, False)] * layers + [(13, False)] * layers


@pytest.mark.parametrize("order", ["after", "side"])
def test_shrink_orders_match_too(setup, order, monkeypatch):
    """ops/lora/overlap.py's shrink_order: the products' shrink right after the GEMM ("after", with PDL and the Triton
    GEMM: its kernel's AFTER_GEMM variant releases the consumer first and waits last, nothing in the interpreter) or
    before it on one stream ("side" in eager forwards); the same products as transformers + PEFT."""
    if setup.variant != BIASED:
        pytest.skip("one configuration (biased q/k/v before RoPE's product) covers the order (~10 s a run here)")
    from loraplex.ops.lora import overlap, sgmv
    monkeypatch.setattr(overlap, "shrink_order", lambda x, weight: order)
    afters, calls = [], _lora_calls(monkeypatch)
    real = sgmv.shrink_into
    monkeypatch.setattr(sgmv, "shrink_into", lambda *a, **kw: afters.append(kw.get("after_gemm", False))
                        or real(*a, **kw))
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, [("all-r8", 0, 6), ("attn-r4", 4, 1), (None, 3, 5)])
    finally:
        setup.model.backend = None
    # every product's shrink (and only those) after its GEMM
    assert calls["product"] and afters.count(True) == (len(calls["product"]) if order == "after" else 0), afters


def test_decode_forwards_of_few_rows_leave_only_the_qkv_product(setup, monkeypatch):
    """A decode forward of at most lora_plan.FEW_ROWS rows (here 3): only q/k/v's product goes to its consumer
    (RoPE); o's, gate/up's and down's are expanded beside their GEMMs; a forward with prompts leaves o's and down's
    products too, however few its rows (here 4). The logits still match transformers + PEFT."""
    if setup.variant != TEXT:
        pytest.skip("one configuration covers it (each run takes ~10 s here)")
    from loraplex.models.lora_plan import EXPAND_IN_CONSUMER, FEW_ROWS, expand_in_consumer
    assert FEW_ROWS == 4 and expand_in_consumer(FEW_ROWS, decode=True) == {"q_proj"}
    assert expand_in_consumer(FEW_ROWS + 1, decode=True) >= EXPAND_IN_CONSUMER > {"q_proj"}
    assert expand_in_consumer(1, decode=False) == EXPAND_IN_CONSUMER
    calls = _lora_calls(monkeypatch)
    setup.model.backend = "triton"
    try:   # prompt chunks of 2, 1 and 1 tokens, then one decode row each
        check_mixed_batch(setup, [("all-r8", 2, 1), ("attn-r4", 1, 1), (None, 1, 1)])
    finally:
        setup.model.backend = None
    layers = setup.config.num_hidden_layers
    assert [r for r, _ in calls["product"]] == [4] * 3 * layers + [3] * layers      # q, o, down; then q alone
    assert [r for r, _ in calls["delta"]] == [4] * layers + [3] * 3 * layers        # gate/up; then o, gate/up, down


def test_decode_forwards_of_up_to_32_rows_leave_gate_up_to_silu(setup, monkeypatch):
    """A decode forward of FEW_ROWS + 1 to DECODE_MAX_ROWS rows (here 6): gate/up's product goes to SiLU-and-mul too,
    while a forward with prompts keeps its expand. The logits still match transformers + PEFT."""
    if setup.variant != TEXT:
        pytest.skip("one configuration covers it (each run takes ~10 s here)")
    from loraplex.models.lora_plan import DECODE_MAX_ROWS, EXPAND_IN_CONSUMER, expand_in_consumer
    assert DECODE_MAX_ROWS == 32
    assert expand_in_consumer(6, decode=True) == expand_in_consumer(32, decode=True) == EXPAND_IN_CONSUMER | {"gate_proj"}
    assert expand_in_consumer(6, decode=False) == EXPAND_IN_CONSUMER
    calls = _lora_calls(monkeypatch)
    setup.model.backend = "triton"
    try:   # prompt chunks of 9 tokens in all, then one decode row each (gate/up's LoRA in four of them)
        check_mixed_batch(setup, [("all-r8", 3, 1), ("mlp-patterned", 2, 1), (None, 1, 1), ("attn-r4", 1, 1),
                                  ("all-r8", 1, 1), ("mlp-patterned", 1, 1)])
    finally:
        setup.model.backend = None
    layers = setup.config.num_hidden_layers
    assert [r for r, _ in calls["product"]] == [9] * 3 * layers + [6] * 4 * layers   # q, o, down; then gate/up too
    assert [r for r, _ in calls["delta"]] == [9] * layers                             # gate/up with the prompts


def test_skinny_gemm_projections_match_too(setup, monkeypatch):
    """LORAPLEX_SKINNY_GEMM=on (ops/gemm/skinny.py): every projection (and the LM head) of a forward of at most
    DECODE_MAX_ROWS rows runs the Triton GEMM (here in the interpreter, with the LoRA kernels of the "decode"
    plan), a mixed forward of 9 rows and a decode forward of 6; the logits still match transformers + PEFT."""
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
    calls = _lora_calls(monkeypatch)
    setup.model.backend = "triton"
    try:
        check_mixed_batch(setup, [("all-r8", 3, 1), ("mlp-patterned", 2, 1), (None, 1, 1), ("attn-r4", 1, 1),
                                  ("all-r8", 1, 1), ("mlp-patterned", 1, 1)])
    finally:
        setup.model.backend = None
    layers = setup.config.num_hidden_layers
    # q/k/v, o, gate/up and down of both forwards, and the LM head on the rows that get logits (3, then 6)
    assert rows == [9] * 4 * layers + [3] + [6] * 4 * layers + [6]
    assert len(calls["product"]) == 7 * layers             # and the LoRA took the "decode" plan's way beside them


def test_eager_decode_steps_leave_the_products_their_graph_would():
    """A decode step of n sequences replays the graph of the smallest bucket that holds it (engine/cuda_graphs.py):
    eager, it leaves the same products to their consumers as that graph does (so the two compute alike)."""
    from loraplex.engine.cuda_graphs import graph_buckets
    from loraplex.models.lora_plan import expand_in_consumer
    for max_batch in range(1, 70):
        buckets = graph_buckets(max_batch)
        for n in range(1, max_batch + 1):
            bucket = next(b for b in buckets if b >= n)
            assert expand_in_consumer(n, decode=True) == expand_in_consumer(bucket, decode=True), (max_batch, n, bucket)


def test_the_plan_is_chosen_once_from_the_batch(monkeypatch):
    """LoraPlan.make's kinds: "none" without a pool or without adapters in the batch, "reference" off Triton,
    "decode" up to 32 rows, "beside" for captured forwards of 33-128 rows, "tiles" otherwise."""
    from loraplex.models.lora_plan import LoraPlan
    from loraplex.ops import LoraBatch
    lora, pool, cpu, cuda = LoraBatch.from_lengths([1], [0]), object(), torch.device("cpu"), torch.device("cuda")
    assert LoraPlan.make(8, True, lora, None, True, None, cpu).kind == "none"
    assert LoraPlan.make(8, True, lora, pool, False, "triton", cpu).kind == "none"
    assert LoraPlan.make(8, True, lora, pool, True, "reference", cuda).kind == "reference"
    for capturing in (False, True):
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        kinds = [LoraPlan.make(rows, False, lora, pool, True, "triton", cuda) for rows in (1, 32, 33, 128, 129)]
        assert [p.kind for p in kinds] == ["decode", "decode"] + (["beside"] * 2 if capturing else ["tiles"] * 2) + \
            ["tiles"]
        assert all(p.capturing == capturing for p in kinds[:-1])
        assert kinds[0].expand_in_consumer == {"q_proj", "o_proj", "down_proj"}


def test_mixed_graph_batch_matches_transformers_peft(setup):
    """A mixed step through a graph batch (engine/cuda_graphs.py's mixed graphs): padded rows and sequences
    change nothing."""
    check_mixed_batch(setup, PLAN, graph_room=(12, 72))


def check_mixed_batch(setup, plan, graph_room: tuple[int, int] | None = None):
    rng = random.Random(7)
    V = setup.config.vocab_size
    tokens = [[rng.randrange(V) for _ in range(c + n)] for _, c, n in plan]
    kv = setup.new_cache()
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

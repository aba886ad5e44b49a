"""The forward on the GPU in bf16, Triton kernels throughout, against transformers + PEFT.

A Llama-2-7B-shaped model (and a Llama-3-8B-shaped one, GQA) cut to 2 layers, with bf16
weights saved by transformers. The truth is transformers + PEFT in float32 on the same
(bf16-valued) weights. Tolerance: our bf16 error against the truth may be at most twice
transformers' own bf16 error against it (plus 2e-3 of the logit scale): both round the same
weights and activations to bf16 (2^-9 relative) at each step, in different places (our
LoRA keeps its intermediate in fp32, our norms and attention are fused), so neither should
be much further from float32 than the other; a real bug (a wrong position, head or adapter)
moves logits by tens of percent.
"""
from __future__ import annotations

import random
import warnings

import pytest
import torch

from loraplex.adapters import AdapterPool, inspect_peft_adapter, read_peft_adapter
from loraplex.models import ForwardBatch, KVCache, SequenceChunk, load_model

pytestmark = pytest.mark.gpu

BLOCK = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"all-r16": dict(r=16, lora_alpha=32, target_modules=ALL),
            "attn-r8": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            "mlp-r4": dict(r=4, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"])}
SHAPES = {"llama-2-7b": dict(num_key_value_heads=32, intermediate_size=11008),
          "llama-3-8b": dict(num_key_value_heads=8, intermediate_size=14336, rope_theta=500000.0)}


def _hf(folder, dtype, adapter=None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").cuda()
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter).cuda()
    return model.eval()


class Setup:
    def __init__(self, tmp, shape: str) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM, LlamaConfig
        config = LlamaConfig(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32, vocab_size=32000,
                             max_position_embeddings=4096, **SHAPES[shape])
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():  # unit-gain weights: activations O(1) through the layers
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.normal_(0.0, 1.0 if "embed" in name else p.shape[1] ** -0.5)
        self.base = tmp / "base"
        model.to(torch.bfloat16).save_pretrained(self.base)
        self.adapters = {}
        for seed, (name, cfg) in enumerate(ADAPTERS.items()):
            torch.manual_seed(seed + 1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                peft = get_peft_model(_hf(self.base, torch.float32), LoraConfig(init_lora_weights=False, **cfg))
                for n, p in peft.named_parameters():  # PEFT's random B is tiny next to unit-gain weights
                    if "lora_B" in n:
                        p.data.normal_(0.0, 0.5 / p.shape[1] ** 0.5)
            peft.save_pretrained(tmp / name)
            self.adapters[name] = tmp / name
            del peft
        del model
        torch.cuda.empty_cache()
        self.ours = load_model(self.base, dtype="bfloat16", device="cuda")
        self.config = self.ours.config
        self.pool = AdapterPool(self.config, num_slots=4, max_rank=16, dtype=torch.bfloat16, device="cuda")
        self.slots = {None: -1}
        for slot, (name, folder) in enumerate(self.adapters.items()):
            spec = inspect_peft_adapter(folder, self.config, name=name)
            self.pool.write(slot, read_peft_adapter(spec, torch.bfloat16))
            self.slots[name] = slot

    def reference_logits(self, seqs: list[tuple[str | None, list[int]]], dtype) -> list[torch.Tensor]:
        """Last-position logits of transformers (+ PEFT), one sequence at a time."""
        out = []
        for adapter in dict.fromkeys(a for a, _ in seqs):
            model = _hf(self.base, dtype, self.adapters.get(adapter))
            with torch.no_grad():
                for a, tokens in seqs:
                    if a == adapter:
                        out.append((seqs.index((a, tokens)),
                                    model(input_ids=torch.tensor([tokens], device="cuda")).logits[0, -1].float()))
            del model
            torch.cuda.empty_cache()
        return [t for _, t in sorted(out, key=lambda p: p[0])]


@pytest.fixture(scope="module", params=list(SHAPES))
def setup(request, tmp_path_factory):
    return Setup(tmp_path_factory.mktemp(request.param), request.param)


def _tables(rng, num_blocks, lengths):
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths]


def _run(setup, kv, chunks):
    batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                               vocab_size=setup.config.vocab_size, device="cuda")
    return setup.ours(batch, kv, setup.pool)


def _assert_as_close_as_transformers(setup, plan, tokens, ours) -> None:
    """Each sequence's bf16 logits within twice transformers + PEFT's own bf16 error (against fp32)."""
    seqs = [(a, t) for (a, _, _), t in zip(plan, tokens)]
    truth = setup.reference_logits(seqs, torch.float32)
    theirs = setup.reference_logits(seqs, torch.bfloat16)
    for i, (adapter, _, _) in enumerate(plan):
        scale = truth[i].abs().max().item()
        ours_err = (ours[i] - truth[i]).abs().max().item() / scale
        hf_err = (theirs[i] - truth[i]).abs().max().item() / scale
        assert ours_err <= 2 * hf_err + 2e-3, (i, adapter, ours_err, hf_err)


@pytest.mark.parametrize("tiles", ["picked", 16])
def test_mixed_bf16_batch_matches_transformers_peft(setup, tiles, monkeypatch):
    """`tiles` 16: the batch's LoRA in 16-row tiles whatever `LoraBatch.pick_block_m` says (it picks them
    for eager mixed steps whose decode rows outweigh their prompts': long prompt segments in small tiles)."""
    if tiles != "picked":
        from loraplex.ops.lora.batch import LoraBatch
        monkeypatch.setattr(LoraBatch, "pick_block_m", staticmethod(lambda lens, slots: tiles))
    rng = random.Random(0)
    # (adapter, cached prefix, new tokens): long and short prefills, chunks over prefixes, decodes
    plan = [("all-r16", 0, 300), ("attn-r8", 200, 57), (None, 700, 1), ("mlp-r4", 1000, 1), ("all-r16", 0, 5),
            ("attn-r8", 63, 1), (None, 0, 129), ("mlp-r4", 17, 33), ("all-r16", 1500, 1)]
    tokens = [[rng.randrange(setup.config.vocab_size) for _ in range(c + n)] for _, c, n in plan]
    kv = KVCache(setup.config, 512, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.fill_(float("nan"))
    tables = _tables(rng, kv.num_blocks, [len(t) for t in tokens])
    prefixes = [SequenceChunk(t[:c], 0, tab, setup.slots[a], needs_logits=False)
                for (a, c, _), t, tab in zip(plan, tokens, tables) if c > 0]
    _run(setup, kv, prefixes)
    ours = _run(setup, kv, [SequenceChunk(t[c:], c, tab, setup.slots[a])
                            for (a, c, _), t, tab in zip(plan, tokens, tables)])
    _assert_as_close_as_transformers(setup, plan, tokens, ours)


@pytest.mark.parametrize("rows, order", [(8, "auto"), (8, "side"), (3, "auto")])
def test_decode_graph_replays_new_batches(setup, rows, order, monkeypatch):
    """Capture one decode forward on a `for_graph` batch, rewrite the batch with other sequences, lengths and adapters
    (and fewer of them), replay: each replay equals an eager forward. The capture takes the LoRA plan's "decode" kind
    (models/lora_plan.py): at 8 rows every projection leaves its product for the next op to expand, the shrink right
    after the GEMM where PDL is on (ops/lora/overlap.py's shrink_order; "side": on a side stream beside the GEMM, as
    without PDL); at 3 rows only q/k/v's, the others expanded beside their GEMMs on the side stream."""
    from loraplex.models.lora_plan import expand_in_consumer
    from loraplex.ops import pdl
    from loraplex.ops.lora import overlap
    if order == "side":
        monkeypatch.setattr(overlap, "shrink_order", lambda x, weight: "side")
    after = order == "auto" and bool(pdl.PDL)
    monkeypatch.setattr(overlap, "_SIDE_STREAMS", {})
    product_sides = []   # `side` of each linear_with_lora_product call
    real = overlap.linear_with_lora_product
    monkeypatch.setattr(overlap, "linear_with_lora_product",
                        lambda *a, **kw: product_sides.append(kw["side"]) or real(*a, **kw))
    rng = random.Random(1)
    # room for `rows` contexts of up to 1024 tokens (each call of decode_chunks draws its blocks afresh)
    kv = KVCache(setup.config, max(640, rows * 1024 // BLOCK), BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_()
    graph_batch = ForwardBatch.for_graph(rows, 1024, block_size=BLOCK, num_blocks=kv.num_blocks,
                                         vocab_size=setup.config.vocab_size, num_adapter_slots=4, device="cuda")

    def decode_chunks(n: int) -> list[SequenceChunk]:
        lengths = [rng.randrange(1, 1024) for _ in range(n)]
        tables = _tables(rng, kv.num_blocks, lengths)
        return [SequenceChunk([rng.randrange(32000)], L - 1, tab, rng.choice([-1, 0, 1, 2]))
                for L, tab in zip(lengths, tables)]

    graph_batch.update_(decode_chunks(rows))
    setup.ours(graph_batch, kv, setup.pool)  # warm-up: compiles every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    eager_sides = list(product_sides)
    with torch.cuda.graph(graph):
        out = setup.ours(graph_batch, kv, setup.pool)
    # the side stream only while capturing, and only where some LoRA kernel runs beside a GEMM
    everything_after = after and len(expand_in_consumer(rows, decode=True)) == 4
    assert bool(overlap._SIDE_STREAMS) == (not everything_after)
    captured_sides = product_sides[len(eager_sides):]
    per_forward = len(expand_in_consumer(rows, decode=True)) * setup.config.num_hidden_layers
    assert eager_sides == [False] * per_forward and per_forward > 0
    assert captured_sides == [True] * per_forward
    for n in (rows, 3, rows, 1):
        chunks = decode_chunks(n)
        graph_batch.update_(chunks)
        with torch.inference_mode():  # the forward's outputs are inference tensors
            out.fill_(float("nan"))
        graph.replay()
        batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                                   vocab_size=setup.config.vocab_size, device="cuda")
        batch.max_seq_len = graph_batch.max_seq_len  # the same split-KV plan, so the same bits
        eager = setup.ours(batch, kv, setup.pool)
        torch.cuda.synchronize()
        if n == graph_batch.num_tokens:
            assert torch.equal(out, eager), n
        else:  # all rows against n: cuBLAS may pick another GEMM for the other M, so allow bf16 rounding
            scale = eager.abs().max().item()
            assert (out[:n] - eager).abs().max().item() <= 2e-2 * scale, n


@pytest.mark.parametrize("room", [64, 160])
def test_mixed_graph_replays_new_batches(setup, room):
    """A mixed-step graph (engine/cuda_graphs.py): captured once on a `for_graph` batch with room for 64
    prompt tokens beside 16 sequences, replayed with other mixes of prompt chunks (with or without a
    cached prefix) and decodes, adapters and none: each replay's logits equal an eager forward's up to bf16
    rounding (the padded rows change cuBLAS's GEMM and the LoRA tiling). With room for 64 prompt tokens the graph
    runs the LoRA plan's "beside" kind (the shrink on a side stream beside each GEMM), with 160 its "tiles" kind."""
    rng = random.Random(4)
    kv = KVCache(setup.config, 1400, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_()
    graph_batch = ForwardBatch.for_graph(16, 1024, block_size=BLOCK, num_blocks=kv.num_blocks,
                                         vocab_size=setup.config.vocab_size, num_adapter_slots=4, device="cuda",
                                         max_prompt_tokens=room)
    def mixed_chunks(decodes: int, prompts: list[int]) -> list[SequenceChunk]:
        news = [1] * decodes + prompts
        cached = [rng.randrange(1, 900) if n == 1 or rng.random() < 0.5 else 0 for n in news]
        tables = _tables(rng, kv.num_blocks, [c + n for c, n in zip(cached, news)])
        chunks = [SequenceChunk([rng.randrange(32000) for _ in range(n)], c, tab, rng.choice([-1, 0, 1, 2]),
                                needs_logits=n == 1 or rng.random() < 0.7)
                  for n, c, tab in zip(news, cached, tables)]
        rng.shuffle(chunks)
        return chunks

    graph_batch.update_(mixed_chunks(15, [40]))
    setup.ours(graph_batch, kv, setup.pool)  # warm-up: compiles every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = setup.ours(graph_batch, kv, setup.pool)
    for decodes, prompts in ((15, [40]), (3, [20, 30, 2]), (0, [64]), (10, []), (12, [5, 9])):
        chunks = mixed_chunks(decodes, prompts)
        graph_batch.update_(chunks)
        with torch.inference_mode():
            out.fill_(float("nan"))
        graph.replay()
        batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                                   vocab_size=setup.config.vocab_size, device="cuda")
        batch.max_seq_len = graph_batch.max_seq_len
        eager = setup.ours(batch, kv, setup.pool)
        torch.cuda.synchronize()
        n = len(batch.logits_seqs)
        assert graph_batch.logits_seqs == batch.logits_seqs and n > 0
        assert torch.isfinite(out[:n]).all()
        scale = eager.abs().max().item()
        assert (out[:n] - eager).abs().max().item() <= 2e-2 * scale, (decodes, prompts)


def test_decode_graph_of_one_shared_adapter_replays_the_eager_bits(setup):
    """32 decode rows on one adapter: an eager batch would pick 64-row LoRA tiles by its own rule, but
    batches of up to lora_plan.DECODE_MAX_ROWS rows take the graphs' 16-row tiles, so the replay and the eager
    forward give the same bits."""
    rng = random.Random(3)
    kv = KVCache(setup.config, 1100, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.normal_()
    lengths = [rng.randrange(1, 512) for _ in range(32)]
    tables = _tables(rng, kv.num_blocks, lengths)
    chunks = [SequenceChunk([rng.randrange(32000)], n - 1, tab, 0) for n, tab in zip(lengths, tables)]
    graph_batch = ForwardBatch.for_graph(32, 512, block_size=BLOCK, num_blocks=kv.num_blocks,
                                         vocab_size=setup.config.vocab_size, num_adapter_slots=4, device="cuda")
    graph_batch.update_(chunks)
    setup.ours(graph_batch, kv, setup.pool)  # warm-up: compiles every kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = setup.ours(graph_batch, kv, setup.pool)
    with torch.inference_mode():
        out.fill_(float("nan"))
    graph.replay()
    batch = ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                               vocab_size=setup.config.vocab_size, device="cuda")
    batch.max_seq_len = graph_batch.max_seq_len  # the same split-KV plan
    assert batch.lora.block_m == graph_batch.lora.block_m
    eager = setup.ours(batch, kv, setup.pool)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("variant", ["llama-gqa-llama3rope", "mistral-gqa4-window", "qwen2-bias-tied-window"])
def test_tiny_variants_in_bf16_match_transformers(variant, tmp_path):
    """The CPU fixtures' architectures (Qwen2 biases and sliding layers, Mistral windows, tied
    embeddings, llama3 RoPE) through the Triton kernels in bf16, with the same tolerance rule."""
    from adapter_fixtures import make_adapter
    from model_fixtures import HFOracle, make_hf_model
    base = make_hf_model(tmp_path / "base", variant)
    adapter = make_adapter(base, tmp_path / "lora", r=8, lora_alpha=16, target_modules=ALL)
    ours = load_model(base, dtype="bfloat16", device="cuda")
    pool = AdapterPool(ours.config, num_slots=2, max_rank=8, dtype=torch.bfloat16, device="cuda")
    pool.write(1, read_peft_adapter(inspect_peft_adapter(adapter, ours.config), torch.bfloat16))
    rng = random.Random(2)
    plan = [(1, 0, 40), (-1, 20, 1), (1, 33, 7), (1, 50, 1)]  # (slot, cached, new): windows 6–7 matter
    tokens = [[rng.randrange(ours.config.vocab_size) for _ in range(c + n)] for _, c, n in plan]
    kv = KVCache(ours.config, 64, BLOCK, dtype=torch.bfloat16, device="cuda")
    kv.data.fill_(float("nan"))
    tables = _tables(rng, kv.num_blocks, [len(t) for t in tokens])

    def run(chunks):
        return ours(ForwardBatch.build(chunks, block_size=BLOCK, num_blocks=kv.num_blocks,
                                       vocab_size=ours.config.vocab_size, device="cuda"), kv, pool)

    run([SequenceChunk(t[:c], 0, tab, s, needs_logits=False) for (s, c, _), t, tab in zip(plan, tokens, tables)
         if c > 0])
    logits = run([SequenceChunk(t[c:], c, tab, s) for (s, c, _), t, tab in zip(plan, tokens, tables)])
    truth = HFOracle(base, {"lora": adapter})
    for i, (slot, _, _) in enumerate(plan):
        name = "lora" if slot >= 0 else None
        expect = truth.logits(tokens[i], name)[-1]
        hf_bf16 = _hf_cpu_bf16(base, adapter if slot >= 0 else None, tokens[i])
        scale = expect.abs().max().item()
        ours_err = (logits[i].cpu() - expect).abs().max().item() / scale
        hf_err = (hf_bf16 - expect).abs().max().item() / scale
        assert ours_err <= 2 * hf_err + 2e-3, (variant, i, ours_err, hf_err)


def _hf_cpu_bf16(base, adapter, tokens) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, attn_implementation="eager")
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()

"""Requests that combine adapters with weights (issue 42), against transformers + PEFT, which nobody here wrote.

A composition {a: w_a, b: w_b, ...} must give what PEFT gives with the adapter `add_weighted_adapter([a, b, ...],
[w_a, w_b, ...], combination_type="cat")` makes: for every projection y += Σ_i w_i · scaling_i · (x @ A_iᵀ) @ B_iᵀ,
each adapter with its own rank, scaling (rsLoRA included) and target modules. Checked on the engine's greedy tokens
for Llama, Mistral and Qwen2 (in a batch beside single-adapter and base-model requests, under chunked prefill,
preemption and fewer GPU slots than adapters), on the logits of one forward through the reference ops and the
Triton kernels (in the CPU interpreter), and on requests refused with the field and member named.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from composition_fixtures import REQUESTS, CatOracle, as_key
from engine_fixtures import make_served_model, random_prompts
from loraplex import LLM, SamplingParams
from loraplex.adapters import AdapterError
from loraplex.adapters.composition import Composition

VOCAB = 128
GREEDY = dict(temperature=0.0, ignore_eos=True)
TOKENS = 10
REL = 1e-4   # fp32 logits against transformers + PEFT (test_model_vs_hf.py's bound)
FAMILIES = {"llama": "llama-gqa-llama3rope", "mistral": "mistral-gqa4-window", "qwen2": "qwen2-bias-tied-window"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    base, adapters = make_served_model(tmp_path_factory.mktemp(request.param), FAMILIES[request.param])
    return base, adapters, CatOracle(base, adapters)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    base, adapters = make_served_model(tmp_path_factory.mktemp("llama-compose"), FAMILIES["llama"])
    return base, adapters, CatOracle(base, adapters)


def make_llm(served, **settings) -> LLM:
    base, adapters, _ = served
    defaults = dict(dtype="float32", device="cpu", num_kv_blocks=256, block_size=8, max_num_seqs=16,
                    max_num_batched_tokens=256, max_gpu_adapters=4)
    return LLM(str(base), adapters={k: str(v) for k, v in adapters.items()}, **{**defaults, **settings})


def requests(n_each: int, seed: int, limit: int = 4) -> tuple[list[list[int]], list]:
    """Prompts and their adapters: `n_each` of each of REQUESTS with at most `limit` members, interleaved."""
    kinds = [r for r in REQUESTS if r is None or isinstance(r, str) or len(r) <= limit]
    which = [kinds[i % len(kinds)] for i in range(n_each * len(kinds))]
    return random_prompts(len(which), VOCAB, (3, 40), seed=seed), which


def test_composed_greedy_tokens_equal_peft_cat_beside_single_and_base_requests(served):
    _, _, oracle = served
    prompts, which = requests(1, seed=1)
    with make_llm(served) as llm:   # one batch: compositions, a single adapter and the base model side by side
        outs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, **GREEDY), adapter=which)
        engine = llm.engine
        assert all(engine.adapters.pins(n) == 0 for n in engine.adapters.names())
        assert engine.blocks.num_free == engine.blocks.num_blocks
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, as_key(adapter), TOKENS), f"adapter {adapter}"
        members = () if adapter is None else (adapter,) if isinstance(adapter, str) else tuple(adapter)
        assert out.adapters == members and out.finish_reason == "length"
        assert out.adapter == (adapter if not isinstance(adapter, dict) else str(Composition.parse(adapter)))
    # not a test that cannot fail: composed tokens differ from those of every member alone (the logits of each
    # composition differ from its members': test_one_mixed_forward_gives_peft_cat_logits)
    composed = [(p, a) for p, a in zip(prompts, which) if isinstance(a, dict) and len(a) > 1]
    assert any(all(oracle.greedy(p, as_key(a), TOKENS) != oracle.greedy(p, n, TOKENS) for n in a) for p, a in composed)


@pytest.mark.parametrize("setting", ["chunked", "preempted", "two-slots"])
def test_composed_tokens_hold_under_chunking_preemption_and_few_slots(llama, setting):
    _, _, oracle = llama
    settings = {
        "chunked": dict(max_num_batched_tokens=16, max_num_seqs=4),            # prompts over many steps
        "preempted": dict(num_kv_blocks=10, max_num_seqs=8, admission_lookahead=0),   # 80 tokens of KV
        "two-slots": dict(max_gpu_adapters=2),                                 # members take turns in 2 slots
    }[setting]
    prompts, which = requests(1, seed=2, limit=2 if setting == "two-slots" else 4)
    with make_llm(llama, **settings) as llm:
        if setting != "two-slots":   # resident first: admissions (and so preemptions) do not vary with load times
            for name in llama[1]:
                assert llm.engine.adapters.wait_resident(name, timeout=30)
        outs = llm.generate(prompts, SamplingParams(max_tokens=TOKENS, **GREEDY), adapter=which)
        engine = llm.engine
        assert all(engine.adapters.pins(n) == 0 for n in engine.adapters.names())
        assert engine.blocks.num_free == engine.blocks.num_blocks
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, as_key(adapter), TOKENS), f"adapter {adapter}"
    if setting == "preempted":
        assert any(o.metrics.num_preemptions and len(o.adapters) > 1 for o in outs), "no composition was preempted"
    if setting == "chunked":
        assert engine.stats["steps"] >= sum(map(len, prompts)) // 16


def test_a_running_composition_pins_every_member_until_it_ends(llama):
    with make_llm(llama) as llm:
        engine = llm.engine
        for name in ("all-r8", "qv-r4"):
            assert engine.adapters.wait_resident(name, timeout=30)
        engine.add_request("mix", list(range(3, 30)), SamplingParams(max_tokens=50, **GREEDY),
                           adapter={"all-r8": 0.5, "qv-r4": 2.0})
        engine.add_request("one", list(range(5, 20)), SamplingParams(max_tokens=50, **GREEDY), adapter="all-r8")
        for _ in range(2):
            engine.step()
        assert engine.adapters.pins("all-r8") == 2 and engine.adapters.pins("qv-r4") == 1
        assert engine.last_step.adapters == ("all-r8", "qv-r4")   # each member counts as an adapter of the step
        assert engine.abort("mix").adapters == ("all-r8", "qv-r4")
        assert engine.adapters.pins("all-r8") == 1 and engine.adapters.pins("qv-r4") == 0
        engine.abort("one")
        assert engine.adapters.pins("all-r8") == 0


def test_named_compositions_run_by_name_and_protect_their_members(llama):
    _, _, oracle = llama
    prompt = random_prompts(1, VOCAB, (12, 12), seed=3)[0]
    mix = Composition.parse({"qv-r4": 1.5, "mlp-r2-rslora": -0.7})
    with make_llm(llama) as llm:
        engine = llm.engine
        engine.add_composition("qv-mlp", mix)
        assert engine.compositions() == {"qv-mlp": mix}
        out = llm.generate([prompt], SamplingParams(max_tokens=TOKENS, **GREEDY), adapter="qv-mlp")[0]
        assert out.token_ids == oracle.greedy(prompt, mix, TOKENS)
        assert out.adapter == "qv-mlp" and out.adapters == ("qv-r4", "mlp-r2-rslora")
        with pytest.raises(AdapterError, match="'qv-r4' is a member of the composition.*qv-mlp.*remove them first"):
            engine.remove_adapter("qv-r4")
        for name, comp, error, words in [
            ("qv-r4", mix, AdapterError, "already registered"),              # an adapter's name
            ("qv-mlp", mix, AdapterError, "already registered"),             # a composition's
            ("bad name", mix, AdapterError, "not allowed"),
            ("x", Composition.parse({"qv-r4": 1.0, "nope": 1.0}), AdapterError, r"\['nope'\]: unknown adapter"),
            ("x", Composition.parse({"qv-mlp": 1.0, "all-r8": 1.0}), AdapterError, "'qv-mlp' is a composition"),
            ("x", {"qv-r4": 1.0}, ValueError, "must be a Composition"),
        ]:
            with pytest.raises(error, match=words):
                engine.add_composition(name, comp)
        with pytest.raises(AdapterError, match="already registered"):
            engine.add_adapter("qv-mlp", llama[1]["qv-r4"])
        engine.remove_composition("qv-mlp")
        assert engine.compositions() == {}
        with pytest.raises(AdapterError, match="unknown composition"):
            engine.remove_composition("qv-mlp")
        engine.remove_adapter("qv-r4")   # no composition uses it now
        assert "qv-r4" not in engine.adapters


def test_bad_compositions_are_refused_naming_the_field_and_member(llama, monkeypatch):
    with make_llm(llama, max_gpu_adapters=2) as llm:
        engine = llm.engine
        # a member whose load failed (until its back-off ends: adapters/loads.py) is refused at submission
        monkeypatch.setattr(engine.adapters, "error", lambda name: "corrupt" if name == "qv-r4" else None)
        cases = [
            ({"all-r8": 1.0, "nope": 0.5}, AdapterError, r"adapter\['nope'\]: unknown adapter 'nope'"),
            ({"all-r8": float("nan")}, ValueError, r"adapter\['all-r8'\]: the weight must be finite"),
            ({"all-r8": float("inf"), "qv-r4": 1.0}, ValueError, "must be finite"),
            ({"all-r8": "1"}, ValueError, "must be a number"),
            ({f"a{i}": 1.0 for i in range(5)}, ValueError, "combines 5 adapters; at most 4"),
            ({"all-r8": 1.0, "qv-r4": 1.0, "mlp-r2-rslora": 1.0}, ValueError, "more than the engine's 2 GPU adapter"),
            (["all-r8", "qv-r4"], ValueError, "must be an adapter name or a mapping"),
            ("nope", AdapterError, "unknown adapter 'nope'"),
            ({"all-r8": 1.0, "qv-r4": 0.5}, AdapterError,
             r"adapter\['qv-r4'\]: adapter 'qv-r4' failed to load: corrupt"),
            ("qv-r4", AdapterError, "^adapter 'qv-r4' failed to load: corrupt"),
        ]
        for adapter, error, words in cases:
            with pytest.raises(error, match=words):
                engine.add_request("x", [5, 6, 7], SamplingParams(), adapter=adapter)
        assert not engine.has_unfinished()
        monkeypatch.undo()
        with pytest.raises(ValueError, match="given twice"):
            Composition.from_pairs([("all-r8", 1.0), ("all-r8", 0.5)])
        # weights of 0 mean absent: all of them 0 is the base model
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, **GREEDY), adapter={"all-r8": 0.0})[0]
        assert out.adapters == () and out.adapter is None


@pytest.mark.parametrize("limit", [1, 2])
def test_max_adapters_per_request_refuses_larger_compositions(llama, limit):
    with make_llm(llama, max_adapters_per_request=limit) as llm:
        engine = llm.engine
        with pytest.raises(ValueError, match="max_adapters_per_request"):
            engine.add_request("x", [5, 6], adapter={"all-r8": 1.0, "qv-r4": 1.0, "mlp-r2-rslora": 1.0})
        if limit == 1:   # one adapter at weight 1 only: weights need the composed path
            with pytest.raises(ValueError, match="max_adapters_per_request=1"):
                engine.add_request("x", [5, 6], adapter={"all-r8": 0.5})
        outs = llm.generate([[5, 6, 7]] * 2, SamplingParams(max_tokens=3, **GREEDY),
                            adapter=["all-r8", {"all-r8": 1.0, "qv-r4": -1.0} if limit == 2 else None])
        assert [o.finish_reason for o in outs] == ["length", "length"]


def test_a_composition_whose_member_fails_ends_alone(llama, tmp_path):
    _, adapters, oracle = llama
    broken = tmp_path / "broken"
    shutil.copytree(adapters["qv-r4"], broken)
    prompts, which = requests(1, seed=4)
    with make_llm(llama) as llm:
        engine = llm.engine
        engine.add_adapter("broken", broken)
        (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")   # breaks after registration
        bad = {"all-r8": 0.5, "broken": 1.0}
        outs = llm.generate(prompts + [[7, 8, 9]], SamplingParams(max_tokens=TOKENS, **GREEDY), adapter=which + [bad])
        assert engine.blocks.num_free == engine.blocks.num_blocks
        assert all(engine.adapters.pins(n) == 0 for n in engine.adapters.names())
    assert outs[-1].finish_reason == "error" and "'broken'" in outs[-1].error and outs[-1].token_ids == []
    for prompt, adapter, out in zip(prompts, which, outs):
        assert out.token_ids == oracle.greedy(prompt, as_key(adapter), TOKENS), f"adapter {adapter}"


def test_llm_takes_one_adapter_for_all_or_one_per_prompt(llama):
    _, _, oracle = llama
    prompts = random_prompts(2, VOCAB, (6, 9), seed=5)
    mix = {"all-r8": 0.3, "mlp-r2-rslora": 1.0}
    with make_llm(llama) as llm:
        shared = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), adapter=mix)
        mixed = llm.generate(prompts, SamplingParams(max_tokens=6, **GREEDY), adapter=[None, Composition.parse(mix)])
        with pytest.raises(ValueError, match="adapter has 1 entries for 2 prompts"):
            llm.generate(prompts, adapter=[mix])
    for prompt, out in zip(prompts, shared):
        assert out.token_ids == oracle.greedy(prompt, as_key(mix), 6)
    assert mixed[0].token_ids == oracle.greedy(prompts[0], None, 6)
    assert mixed[1].token_ids == shared[1].token_ids


def test_async_engine_serves_and_names_compositions(llama):
    """AsyncEngine: a mapping as a request's adapter, a named composition registered between steps (and read from
    any thread), a member's removal refused while the composition names it."""
    import asyncio

    from loraplex.config import EngineConfig
    from loraplex.engine.async_engine import AsyncEngine
    base, adapters, oracle = llama
    prompt = random_prompts(1, VOCAB, (8, 8), seed=6)[0]
    mix = Composition.parse({"all-r8": -0.4, "qv-r4": 1.3})
    engine = AsyncEngine(EngineConfig(str(base), dtype="float32", device="cpu", num_kv_blocks=64, block_size=8),
                         adapters={k: str(v) for k, v in adapters.items()})

    async def run(adapter):
        outs = [o async for o in engine.generate(prompt, SamplingParams(max_tokens=6, **GREEDY), adapter=adapter)]
        return outs[-1]
    try:
        inline = asyncio.run(run(dict(mix.members)))
        engine.add_composition("neg-mix", mix)
        assert engine.compositions() == {"neg-mix": mix}
        named = asyncio.run(run("neg-mix"))
        with pytest.raises(AdapterError, match="neg-mix"):
            engine.remove_adapter("all-r8")
        with pytest.raises(AdapterError, match="unknown adapter 'nope'"):
            asyncio.run(run({"nope": 1.0, "all-r8": 1.0}))
        engine.remove_composition("neg-mix")
        engine.remove_adapter("all-r8")
    finally:
        engine.shutdown()
    assert inline.token_ids == named.token_ids == oracle.greedy(prompt, mix, 6)
    assert (inline.adapter, named.adapter) == (str(mix), "neg-mix") and named.adapters == ("all-r8", "qv-r4")


def test_generate_command_combines_repeated_adapter_flags(monkeypatch, capsys, tmp_path):
    """`loraplex generate --adapter NAME=WEIGHT ...`: the pairs become one Composition for every prompt (a name
    alone: weight 1; one name at weight 1: the plain name); refusals exit 2 naming the flag, before any model loads."""
    import loraplex
    from loraplex.cli import main
    adapter_of: list = []

    class FakeLLM:   # records what generate_cmd hands the LLM
        def __init__(self, model, adapters=None, **settings):
            self.adapters = adapters

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def generate(self, prompts, params, adapter=None, **kw):
            adapter_of.append(adapter)
            return [type("Out", (), {"text": "", "finish_reason": "length", "error": None}) for _ in prompts]
    monkeypatch.setattr(loraplex, "LLM", FakeLLM)
    loras = []
    for name in ("sql", "chat", "c", "d", "e"):
        (tmp_path / name).mkdir()
        loras += ["--lora", f"{name}={tmp_path / name}"]

    def generate(*adapter_flags: str) -> int:
        return main(["generate", "--model", "m", "--device", "cpu", "a prompt", *loras, *adapter_flags])
    assert generate("--adapter", "sql=0.7", "--adapter", "chat=-0.3") == 0
    assert generate("--adapter", "sql", "--adapter", "chat=2") == 0
    assert generate("--adapter", "sql") == 0 and generate() == 0
    assert adapter_of == [Composition((("sql", 0.7), ("chat", -0.3))), Composition((("sql", 1.0), ("chat", 2.0))),
                          "sql", None]
    capsys.readouterr()
    for flags, words in [(["sql=1", "sql=0.5"], "--adapter: adapter 'sql' is given twice"),
                         (["sql=nan"], "--adapter['sql']: the weight must be finite"),
                         (["sql", "chat", "c", "d", "e"], "--adapter combines 5 adapters; at most 4"),
                         (["nope=1"], "--adapter nope: not among the --lora names")]:
        assert generate(*[arg for flag in flags for arg in ("--adapter", flag)]) == 2
        assert words in capsys.readouterr().err
    with pytest.raises(SystemExit):   # argparse's own usage error (exit 2)
        generate("--adapter", "sql=")
    assert "expected NAME or NAME=WEIGHT, got 'sql='" in capsys.readouterr().err
    assert len(adapter_of) == 4


# ---- one forward: the reference ops and the Triton kernels (CPU interpreter) ------------------------------------
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_one_mixed_forward_gives_peft_cat_logits(served, backend, monkeypatch):
    """Prefill chunks over cached prefixes and decodes, compositions beside a single adapter and the base model,
    KV pages interleaved and the cache poisoned: each sequence's last logits are PEFT's for it alone, and those of
    a composition are not its members' alone; then one decode each. Through the Triton kernels (on one family: seconds
    a forward in the interpreter) in both eager kinds of the LoRA plan: the prefixes' forward of 20 rows "decode", the
    next of 36 "tiles", the decodes' "decode" (models/lora_plan.py)."""
    from loraplex import ops
    from loraplex.adapters import AdapterPool, inspect_peft_adapter, read_peft_adapter
    from loraplex.models import ForwardBatch, KVCache, SequenceChunk, load_model
    from model_fixtures import assert_logits_close
    if backend == "triton" and not ops.triton_interpreted():
        pytest.skip("needs TRITON_INTERPRET=1 (no CUDA): tests/test_engine_gpu.py runs the kernels for real")
    base, adapters, oracle = served
    if backend == "triton" and model_family(base) != "llama":
        pytest.skip("the LoRA kernels take nothing from the family: one covers them (test_model_vs_hf.py's note)")
    model = load_model(base, dtype=torch.float32)
    pool = AdapterPool(model.config, num_slots=4, max_rank=8, dtype=torch.float32, device="cpu")
    slot = {}
    for i, name in enumerate(adapters):   # slot 0 stays empty: slots need not be dense
        spec = inspect_peft_adapter(adapters[name], model.config, name=name)
        pool.write(i + 1, read_peft_adapter(spec, torch.float32))
        slot[name] = i + 1
    # (adapter, cached prefix, new tokens): a composed prompt chunk, composed decodes, a single adapter, the base
    plan = [(REQUESTS[0], 0, 24), (REQUESTS[2], 6, 1), (REQUESTS[1], 4, 5), ("qv-r4", 3, 1), (None, 0, 4),
            (REQUESTS[3], 7, 1)]
    gen = torch.Generator().manual_seed(6)
    tokens = [torch.randint(3, VOCAB, (c + n,), generator=gen).tolist() for _, c, n in plan]
    kv = KVCache(model.config, 32, 8, dtype=torch.float32)
    kv.data.fill_(float("nan"))
    order = torch.randperm(32, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-(len(t) + 1) // 8))] for t in tokens]   # room for one decode more
    more = [t + [int(torch.randint(3, VOCAB, (1,), generator=gen))] for t in tokens]

    def chunk(i: int, start: int, end: int, logits: bool = True) -> SequenceChunk:
        adapter = Composition.parse(plan[i][0])
        slots = () if adapter is None else tuple(slot[n] for n in adapter.names)
        if len(slots) == 1 and adapter.weights == (1.0,):
            return SequenceChunk(more[i][start:end], start, tables[i], slots[0], logits)
        return SequenceChunk(more[i][start:end], start, tables[i], slots or -1, logits, adapter and adapter.weights)

    from loraplex.models.lora_plan import LoraPlan
    kinds, real_make = [], LoraPlan.make
    monkeypatch.setattr(LoraPlan, "make", lambda *a, **kw: kinds.append(real_make(*a, **kw)) or kinds[-1])
    model.backend = backend

    def forward(chunks):
        batch = ForwardBatch.build(chunks, block_size=8, num_blocks=32, vocab_size=model.config.vocab_size)
        return model(batch, kv, pool)
    prefixes = [i for i, (_, c, _) in enumerate(plan) if c]
    forward([chunk(i, 0, plan[i][1], logits=False) for i in prefixes])
    logits = forward([chunk(i, plan[i][1], len(tokens[i])) for i in range(len(plan))])
    # then one decode each: 6 rows, "decode" (the consumers add each composition's members with its first)
    decoded = forward([chunk(i, len(tokens[i]), len(more[i])) for i in range(len(plan))])
    assert [p.kind for p in kinds] == (["decode", "tiles", "decode"] if backend == "triton" else ["reference"] * 3)
    for got, seqs, what in ((logits, tokens, "prompt"), (decoded, more, "decode")):
        for i, (adapter, _, _) in enumerate(plan):
            expect = oracle.logits(seqs[i], as_key(adapter))[-1]
            assert_logits_close(got[i], expect, REL, f"sequence {i} ({adapter}, {backend}, {what})")
            for member in adapter if isinstance(adapter, dict) else ():
                alone = oracle.logits(seqs[i], member)[-1]
                assert (alone - expect).abs().max() > 100 * REL * expect.abs().max(), (adapter, member)


def model_family(base) -> str:
    return json.loads((base / "config.json").read_text())["model_type"]

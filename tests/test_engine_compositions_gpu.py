"""Requests that combine adapters, in the engine on a CUDA GPU: the composed graph variant, and bf16 against
transformers + PEFT's `add_weighted_adapter(..., combination_type="cat")`. (Apart from test_engine_gpu.py so that
benchmarks/gpu_tests.sh's workers start both files' engines side by side.)"""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import make_llm, make_served_model, random_prompts, record_variants
from loraplex import SamplingParams

pytestmark = pytest.mark.gpu
VOCAB = 128


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    base, adapters = make_served_model(tmp_path_factory.mktemp("served_compositions_gpu"))
    return base, adapters, None


def test_a_weighted_adapter_with_one_gpu_slot_replays_the_composed_graphs(served, monkeypatch):
    """One GPU slot: a request weighing its one adapter ({name: 0.5}) still needs the composed variant, which is
    captured (the graphs' composed capacity is the requests' limit, not the slots); tokens as eager's."""
    _, adapters, _ = served
    name = next(iter(adapters))
    prompts = random_prompts(3, VOCAB, (4, 30), seed=53)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    seen = record_variants(monkeypatch)
    results = {}
    for eager in (False, True):
        with make_llm(served, enforce_eager=eager, max_gpu_adapters=1) as llm:
            results[eager] = [o.token_ids for o in llm.generate(prompts, params, adapter={name: 0.5})]
            assert (llm.engine.stats["graph_steps"] > 0) != eager
    assert "composed" in seen, seen
    assert results[False] == results[True]


@pytest.mark.parametrize("eager", [False, True])
def test_compositions_in_bf16_are_as_close_to_peft_as_transformers_in_bf16(served, monkeypatch, eager):
    """bf16 through the Triton kernels (graph replays and eager steps: prompts, then decodes): each token's top
    logprobs are as close to PEFT cat's in fp32 as transformers + PEFT's own bf16 forward is, the tokens ours:
    over the batch's tokens, the mean error within 1.5× its mean and the largest within twice its largest plus
    0.02 nats. (Not token by token: bf16 rounding alone, on the CPU's torch path as on the kernels, puts single
    tokens of three-member mixes past twice PEFT's error at that token; the fp32 tests check the semantics
    exactly.)"""
    from composition_fixtures import REQUESTS, CatOracle, as_key
    base, adapters, _ = served
    exact, rounded = CatOracle(base, adapters), CatOracle(base, adapters, dtype=torch.bfloat16)
    mixes = [r for r in REQUESTS if isinstance(r, dict)]
    prompts = random_prompts(2 * len(mixes), VOCAB, (4, 40), seed=53)
    which = [mixes[i % len(mixes)] for i in range(len(prompts))]
    seen = record_variants(monkeypatch)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=20, ignore_eos=True)
    with make_llm(served, dtype="bfloat16", enforce_eager=eager) as llm:
        outs = llm.generate(prompts, params, adapter=which)
    assert ("composed" in seen) != eager, seen
    ours_errs, hf_errs = [], []
    for prompt, adapter, out in zip(prompts, which, outs):
        tokens, key = prompt + out.token_ids, as_key(adapter)
        truth = torch.log_softmax(exact.logits(tokens, key).double(), dim=-1)
        theirs = torch.log_softmax(rounded.logits(tokens, key).double(), dim=-1)
        for i, lp in enumerate(out.logprobs):
            row = len(prompt) - 1 + i
            ids = [t for t, _ in lp.top]
            ours_errs.append(max(abs(v - truth[row, t].item()) for t, v in lp.top))
            hf_errs.append((theirs[row, ids] - truth[row, ids]).abs().max().item())
    ours, hf = torch.tensor(ours_errs), torch.tensor(hf_errs)
    assert ours.mean() <= 1.5 * hf.mean(), (ours_errs, hf_errs)
    assert ours.max() <= 2 * hf.max() + 0.02, (ours_errs, hf_errs)

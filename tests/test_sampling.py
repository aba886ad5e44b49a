"""SamplingParams validation and the batched Sampler, checked against a float64 per-row oracle."""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch

from loraplex.sampling import Sampler, SamplerOutput, SamplingParams

# ---------------------------------------------------------------------------------------------
# The oracle: the loop in Sampler.__call__'s docstring, in float64, one row at a time.
# The keyword arguments make deliberately wrong variants, to show the tests can tell them apart.
# ---------------------------------------------------------------------------------------------


def oracle_row(row: torch.Tensor, p: SamplingParams, *, temperature_power: int = 1,
               top_k_shift: int = 0, top_p_shift: int = 0) -> torch.Tensor:
    """The distribution [V] (float64) that the sampler draws row's token from."""
    row = row.double()
    vocab = row.shape[0]
    probs = torch.zeros(vocab, dtype=torch.float64)
    if p.greedy:
        probs[int(torch.argmax(row))] = 1.0
        return probs
    z = row / p.temperature ** temperature_power
    keep = torch.ones(vocab, dtype=torch.bool)
    if p.top_k >= 1:
        k = max(1, min(p.top_k + top_k_shift, vocab))
        kth = sorted(z.tolist(), reverse=True)[k - 1]
        keep = z >= kth  # ties with the k-th value stay
    if p.top_p < 1:
        q = torch.softmax(z.masked_fill(~keep, -math.inf), dim=0)
        order = sorted(range(vocab), key=lambda j: -q[j].item())
        total, count = 0.0, 0
        for j in order:
            total += q[j].item()
            count += 1
            if total >= p.top_p:
                break
        count = max(1, min(count + top_p_shift, vocab))
        keep &= z >= z[order[count - 1]]  # ties with the last kept token stay
    return torch.softmax(z.masked_fill(~keep, -math.inf), dim=0)


def oracle(logits: torch.Tensor, params: list[SamplingParams], **mutation) -> torch.Tensor:
    return torch.stack([oracle_row(logits[i], p, **mutation) for i, p in enumerate(params)])


def random_logits(seed: int, rows: int, vocab: int, scale: float = 2.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


def sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None] | None = None) -> list[int]:
    generators = generators if generators is not None else [None] * len(params)
    return sampler(logits, params, generators).token_ids


# ---------------------------------------------------------------------------------------------
# SamplingParams
# ---------------------------------------------------------------------------------------------

BAD_PARAMS = [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", True), ("max_tokens", 2.0), ("max_tokens", "8"),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", True),
    ("temperature", "1"), ("temperature", None),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.2), ("top_p", math.nan), ("top_p", "0.5"),
    ("top_k", -2), ("top_k", 1.5), ("top_k", True), ("top_k", None),
    ("seed", -1), ("seed", 2**63), ("seed", 1.0), ("seed", True), ("seed", "7"),
    ("stop", ""), ("stop", [""]), ("stop", ["ok", 3]), ("stop", 5), ("stop", b"x"),
    ("stop", ["s"] * 17), ("stop", {"a"}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", [True]), ("stop_token_ids", "12"),
    ("stop_token_ids", 5), ("stop_token_ids", None),
    ("ignore_eos", 1), ("ignore_eos", None), ("skip_special_tokens", "yes"), ("skip_special_tokens", 0),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0), ("logprobs", True),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_PARAMS])
def test_bad_params_raise_naming_field_and_value(field, value):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert f"SamplingParams.{field}" in message
    assert repr(value)[:20] in message


def test_good_params_are_normalized():
    p = SamplingParams(temperature=1, top_k=0, stop="###", stop_token_ids=[2, 7])
    assert p.temperature == 1.0 and type(p.temperature) is float
    assert p.top_k == -1
    assert p.stop == ("###",)
    assert p.stop_token_ids == (2, 7) and isinstance(p.stop_token_ids, tuple)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop=["s"] * 16).stop == ("s",) * 16
    edges = SamplingParams(top_p=1, top_k=1, seed=2**63 - 1, logprobs=20, max_tokens=1)
    assert edges.top_p == 1.0 and type(edges.top_p) is float
    assert SamplingParams(logprobs=0).logprobs == 0
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=1e-3).greedy


def test_check_vocab_names_the_bad_id():
    p = SamplingParams(stop_token_ids=[3, 99])
    p.check_vocab(100)
    with pytest.raises(ValueError, match="99"):
        p.check_vocab(99)
    with pytest.raises(ValueError, match="vocab_size"):
        p.check_vocab(0)


# ---------------------------------------------------------------------------------------------
# Sampler: argument checks
# ---------------------------------------------------------------------------------------------


def test_sampler_rejects_bad_arguments():
    sampler = Sampler("cpu")
    logits = random_logits(1, 2, 8)
    two = [SamplingParams(), SamplingParams()]
    cases = [
        (logits[0], two, [None, None], "\\[N, V\\]"),
        (torch.zeros(2, 0), two, [None, None], "V >= 1"),
        (logits.long(), two, [None, None], "float"),
        (logits, two[:1], [None, None], "1 SamplingParams for 2"),
        (logits, two, [None], "1 generators for 2"),
        (logits, [SamplingParams(), {"temperature": 0}], [None, None], "params\\[1\\]"),
        (logits, two, [None, 7], "generators\\[1\\]"),
        (logits, [SamplingParams(), SamplingParams(seed=3)], [None, None], "seed 3"),
    ]
    for x, params, gens, match in cases:
        with pytest.raises(ValueError, match=match):
            sampler(x, params, gens)
    with pytest.raises(ValueError, match="seed"):
        sampler.new_generator(-1)
    with pytest.raises(ValueError, match="seed"):
        Sampler("cpu", seed=2**63)


def test_empty_batch():
    assert Sampler("cpu")(torch.zeros(0, 5), [], []) == SamplerOutput([], [])


# ---------------------------------------------------------------------------------------------
# Greedy
# ---------------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_draws_nothing():
    sampler = Sampler("cpu")
    logits = random_logits(11, 32, 1000)
    logits[3, :] = 0.5  # all tied: the lowest id wins
    logits[4, [17, 400]] = 100.0
    gens = [sampler.new_generator(5) if i % 2 else None for i in range(32)]
    states = [g.get_state() if g is not None else None for g in gens]
    engine_state = sampler.generator.get_state()
    params = [SamplingParams(temperature=0, seed=5 if i % 2 else None) for i in range(32)]
    assert sample(sampler, logits, params, gens) == torch.argmax(logits, dim=1).tolist()
    assert sample(sampler, logits, params, gens)[3:5] == [0, 17]
    # Greedy rows draw no noise: neither their own generators nor the engine's advance.
    assert all(g is None or torch.equal(g.get_state(), s) for g, s in zip(gens, states))
    assert torch.equal(sampler.generator.get_state(), engine_state)


def test_bfloat16_logits_are_upcast():
    logits = random_logits(12, 8, 64).bfloat16()
    tokens = sample(Sampler("cpu"), logits, [SamplingParams(temperature=0)] * 8)
    assert tokens == torch.argmax(logits.float(), dim=1).tolist()


# ---------------------------------------------------------------------------------------------
# Distribution: against the oracle
# ---------------------------------------------------------------------------------------------

DRAWS = 20_000
# (params, logits seed): seeds picked so that every mutant below that applies is > 3 * bound away.
DISTRIBUTION_CASES = [
    (SamplingParams(temperature=0.6), 0),
    (SamplingParams(temperature=0.5, top_k=6), 1026),
    (SamplingParams(temperature=0.8, top_p=0.8), 2009),
    (SamplingParams(temperature=0.6, top_k=12, top_p=0.7), 3003),
    (SamplingParams(temperature=0.5, top_k=5, top_p=0.9), 4002),
    (SamplingParams(temperature=1.5, top_k=8, top_p=0.6), 5004),
]
MUTANTS = {
    "temperature applied twice": {"temperature_power": 2},
    "temperature ignored": {"temperature_power": 0},
    "top-k keeps one fewer": {"top_k_shift": -1},
    "top-k keeps one more": {"top_k_shift": 1},
    "top-p keeps one fewer": {"top_p_shift": -1},
    "top-p keeps one more": {"top_p_shift": 1},
}


@pytest.mark.parametrize("case", range(len(DISTRIBUTION_CASES)))
def test_frequencies_match_oracle(case):
    p, logits_seed = DISTRIBUTION_CASES[case]
    logits = random_logits(logits_seed, 1, 40)
    expected = oracle(logits, [p])[0]
    assert (expected > 0).sum() >= 4  # a real choice, not a near-greedy row

    # With n draws, each frequency deviates by about sqrt(p_j (1 - p_j) / n), so the expected
    # total-variation distance is about 0.4 * sum_j of that; `bound` is 3.75 times it (the TV
    # of a correct sampler stays well below it). A wrong filter shifts at least 2 * bound of
    # mass, so its empirical TV from the oracle is at least 2 * bound - (its noise) > bound:
    # the loop below checks that for every mutant that applies to this case.
    bound = 1.5 * torch.sqrt(expected * (1 - expected) / DRAWS).sum().item()
    applicable = 0
    for name, mutation in MUTANTS.items():
        wrong = oracle(logits, [p], **mutation)[0]
        if torch.equal(wrong, expected):
            continue  # e.g. a top-k mutant on a row without top-k
        applicable += 1
        distance = 0.5 * (wrong - expected).abs().sum().item()
        assert distance > 2 * bound, f"{name} is too close to the oracle ({distance:.4f}) for this test to see it"
    assert applicable >= 2

    batch = logits.repeat(DRAWS, 1)
    tokens = torch.tensor(sample(Sampler("cpu", seed=case), batch, [p] * DRAWS))
    assert bool((expected[tokens] > 0).all()), "sampled a token outside the kept set"
    frequencies = torch.bincount(tokens, minlength=40).double() / DRAWS
    tv = 0.5 * (frequencies - expected).abs().sum().item()
    assert tv < bound, f"TV {tv:.4f} >= {bound:.4f}"


def test_samples_stay_in_kept_set_with_ties_and_mixed_params():
    sampler = Sampler("cpu", seed=3)
    gen = torch.Generator().manual_seed(21)
    rows, vocab = 64, 100
    choices_t, choices_k, choices_p = [0.3, 0.7, 1.0, 1.8], [-1, 1, 5, 20, 200], [1.0, 0.9, 0.5, 0.05]
    for step in range(40):
        # Logits on a 0.5 grid, so many rows have ties at the top-k and top-p boundaries.
        logits = torch.round(torch.randn(rows, vocab, generator=gen) * 4) / 2
        pick = torch.randint(0, 4, (rows, 3), generator=gen).tolist()
        params = [SamplingParams(temperature=choices_t[a], top_k=choices_k[(b + step) % 5], top_p=choices_p[c])
                  for a, b, c in pick]
        tokens = torch.tensor(sample(sampler, logits, params))
        expected = oracle(logits, params)
        assert bool((expected[torch.arange(rows), tokens] > 0).all())


def test_kept_set_is_exact_under_forced_noise(monkeypatch):
    # Every Exp(1) draw becomes 1 except an exact 0 at token j: the race p / e then picks j
    # whenever j is kept (p_j > 0), and never a cut token (0 / 0 must not become a NaN winner).
    favored = [0]

    def fake_exponential(self, *args, **kwargs):
        self.fill_(1.0)
        self[..., favored[0]] = 0.0
        return self

    monkeypatch.setattr(torch.Tensor, "exponential_", fake_exponential)
    vocab = 24
    rows = list(random_logits(111, 12, vocab, scale=2.0))
    # float32 rounds the top probability of this row to exactly 1: top-p must still cut nothing.
    rows.append(torch.tensor([0.0] + [-20.0 - 0.5 * j for j in range(vocab - 1)]))
    params = [SamplingParams(), SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(top_p=0.05),
              SamplingParams(temperature=0.3, top_k=10, top_p=0.9), SamplingParams(temperature=2.0, top_p=0.7),
              SamplingParams(top_k=1), SamplingParams(top_k=5, top_p=0.95, seed=1), SamplingParams(seed=2),
              SamplingParams(temperature=0.5, top_k=20, top_p=0.99), SamplingParams(top_k=vocab + 5),
              SamplingParams(temperature=0), SamplingParams(top_k=3, top_p=1.0)]
    sampler = Sampler("cpu")
    for row, p in zip(rows, params):
        expected = oracle(row[None], [p])[0]
        gens = [sampler.new_generator(p.seed) if p.seed is not None else None]
        for j in range(vocab):
            favored[0] = j
            token = sample(sampler, row[None], [p], gens)[0]
            assert (token == j) == bool(expected[j] > 0), f"{p}, token {j}: sampled {token}"
            assert expected[token] > 0


def test_ties_at_the_cutoff_all_stay():
    vocab, draws = 10, 4000
    top_k_row = torch.tensor([3.0, 2.0, 2.0, 2.0] + [0.0] * (vocab - 4))
    # softmax([2, 1, 1, 1, 0 ...]): token 0 holds ~0.47, so top_p=0.6 is reached inside the tie.
    top_p_row = torch.tensor([2.0, 1.0, 1.0, 1.0] + [0.0] * (vocab - 4))
    cases = [(top_k_row, SamplingParams(top_k=2)), (top_p_row, SamplingParams(top_p=0.6))]
    for row, p in cases:
        tokens = torch.tensor(sample(Sampler("cpu"), row.repeat(draws, 1), [p] * draws))
        assert set(tokens.tolist()) == {0, 1, 2, 3}
        assert set(torch.nonzero(oracle(row[None], [p])[0]).flatten().tolist()) == {0, 1, 2, 3}


def test_no_sort_without_top_k_or_top_p(monkeypatch):
    def no_sort(*args, **kwargs):
        raise AssertionError("sorted although no row uses top-k or top-p")

    monkeypatch.setattr(torch, "sort", no_sort)
    sampler = Sampler("cpu")
    logits = random_logits(31, 4, 50)
    sample(sampler, logits, [SamplingParams(temperature=0.5, top_k=50), SamplingParams(top_k=80),
                             SamplingParams(temperature=0), SamplingParams(top_p=1.0)])
    with pytest.raises(AssertionError, match="sorted"):  # the patch does see a sort when one is due
        sample(sampler, logits, [SamplingParams(top_k=4)] * 4)


def test_logits_are_not_modified():
    logits = random_logits(41, 6, 30)
    logits[5, 3] = math.nan
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.5, logprobs=2), SamplingParams(temperature=0),
              SamplingParams(), SamplingParams(top_p=0.3), SamplingParams(temperature=3.0, logprobs=0),
              SamplingParams(top_k=2)]
    Sampler("cpu")(logits, params, [None] * 6)
    assert torch.equal(logits.nan_to_num(), before.nan_to_num()) and bool(logits[5, 3].isnan())


# ---------------------------------------------------------------------------------------------
# Seeds
# ---------------------------------------------------------------------------------------------


def seeded_run(seed: int, row: torch.Tensor, p: SamplingParams, place: str, calls: int = 12) -> list[int]:
    """The tokens a seeded row gets over successive calls, alone or among other rows."""
    sampler = Sampler("cpu", seed=len(place))  # the engine's seed must not matter either
    gen = sampler.new_generator(seed)
    others = random_logits(53, 3, row.shape[0])
    other_params = [SamplingParams(seed=99, top_p=0.9), SamplingParams(temperature=0.7), SamplingParams(temperature=0)]
    tokens = []
    for _ in range(calls):
        other_gens = [sampler.new_generator(99), None, None]
        if place == "alone":
            logits, params, gens, at = row[None], [p], [gen], 0
        elif place == "first":
            logits, params, gens, at = torch.cat([row[None], others]), [p] + other_params, [gen] + other_gens, 0
        else:
            logits, params, gens, at = torch.cat([others, row[None]]), other_params + [p], other_gens + [gen], 3
        tokens.append(sample(sampler, logits, params, gens)[at])
    return tokens


@pytest.mark.parametrize("p", [SamplingParams(seed=7), SamplingParams(seed=7, temperature=0.8, top_k=30, top_p=0.9)],
                         ids=["plain", "filtered"])
def test_seeded_row_ignores_its_batch(p):
    row = random_logits(61, 1, 500, scale=0.5)[0]
    alone = seeded_run(7, row, p, "alone")
    assert seeded_run(7, row, p, "first") == alone
    assert seeded_run(7, row, p, "last") == alone
    assert seeded_run(8, row, p, "alone") != alone  # another seed, other tokens
    assert len(set(alone)) > 1  # the generator advances between calls


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax():
    vocab = 200
    logits = random_logits(71, 7, vocab)
    params = [SamplingParams(logprobs=5, temperature=0.5, top_k=3), SamplingParams(),
              SamplingParams(logprobs=0, top_p=0.5), SamplingParams(logprobs=20, temperature=0),
              SamplingParams(logprobs=1, temperature=2.0), SamplingParams(temperature=0),
              SamplingParams(logprobs=20, seed=4, top_k=50, top_p=0.9)]
    sampler = Sampler("cpu")
    gens = [None] * 6 + [sampler.new_generator(4)]
    out = sampler(logits, params, gens)
    reference = torch.log_softmax(logits.double(), dim=1)
    for i, p in enumerate(params):
        lp = out.logprobs[i]
        if p.logprobs is None:
            assert lp is None
            continue
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - reference[i, lp.token_id].item()) < 1e-5
        assert len(lp.top) == p.logprobs
        ids = [t for t, _ in lp.top]
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        assert set(ids) == set(torch.topk(reference[i], p.logprobs).indices.tolist())
        for t, v in lp.top:
            assert abs(v - reference[i, t].item()) < 1e-5


def test_logprobs_top_is_capped_by_vocab():
    out = Sampler("cpu")(random_logits(72, 1, 5), [SamplingParams(logprobs=20)], [None])
    assert len(out.logprobs[0].top) == 5


# ---------------------------------------------------------------------------------------------
# Mixed batch and bad rows
# ---------------------------------------------------------------------------------------------


def test_mixed_batch_matches_rows_alone():
    vocab = 300
    logits = random_logits(81, 8, vocab, scale=1.0)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(seed=1, top_p=0.8),
              SamplingParams(temperature=0.5), SamplingParams(seed=2, top_k=40, temperature=1.5),
              SamplingParams(temperature=0, top_k=3, logprobs=2), SamplingParams(top_p=0.3, top_k=10),
              SamplingParams(seed=3)]
    seeded = {i: p.seed for i, p in enumerate(params) if p.seed is not None}
    batch_sampler = Sampler("cpu", seed=9)
    gens = {i: batch_sampler.new_generator(s) for i, s in seeded.items()}
    together = [batch_sampler(logits, params, [gens.get(i) for i in range(8)]).token_ids for _ in range(5)]

    alone_sampler = Sampler("cpu", seed=10)
    alone_gens = {i: alone_sampler.new_generator(s) for i, s in seeded.items()}
    expected = oracle(logits, params)
    for call in range(5):
        for i, p in enumerate(params):
            if p.greedy or i in seeded:
                alone = sample(alone_sampler, logits[i:i + 1], [p], [alone_gens.get(i)])[0]
                assert together[call][i] == alone, f"row {i}, call {call}"
            assert expected[i, together[call][i]] > 0


def test_nan_rows_give_a_valid_token():
    vocab = 50
    logits = random_logits(91, 6, vocab)
    logits[0] = math.nan
    logits[1, 7] = math.nan
    logits[2] = -math.inf
    params = [SamplingParams(logprobs=3), SamplingParams(top_p=0.5, top_k=4, logprobs=1),
              SamplingParams(temperature=0.5), SamplingParams(temperature=0), SamplingParams(top_k=1),
              SamplingParams(seed=5, top_p=0.7)]
    logits[3, 0] = math.nan
    sampler = Sampler("cpu")
    out = sampler(logits, params, [None] * 5 + [sampler.new_generator(5)])
    assert all(0 <= t < vocab for t in out.token_ids)
    assert out.token_ids[4] == int(torch.argmax(logits[4]))  # clean rows are unaffected
    assert out.finite == [False, False, False, False, True, True]  # the engine ends the others with an error
    alone = Sampler("cpu", seed=1)
    assert out.token_ids[5] == sample(alone, logits[5:], params[5:], [alone.new_generator(5)])[0]


def test_tiny_temperature_behaves_like_greedy():
    logits = random_logits(95, 16, 100)
    tokens = sample(Sampler("cpu"), logits, [SamplingParams(temperature=1e-40)] * 16)
    assert tokens == torch.argmax(logits, dim=1).tolist()


# ---------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_launch_never_syncs_and_same_rules():
    sampler = Sampler("cuda", seed=0)
    logits = random_logits(101, 16, 1000).cuda()
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(top_k=5, seed=3),
              SamplingParams(top_p=0.8, logprobs=0), SamplingParams(temperature=0.7)] * 4
    gens = [sampler.new_generator(3) if p.seed is not None else None for p in params]
    sampler(logits, params, gens)  # warm up (allocator, pinned pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pending = sampler.launch(logits, params, gens)  # queues the work and the copy back: no sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert not syncs, [str(w.message) for w in syncs]
    out = pending.result()   # waits for this sample's event only
    expected = oracle(logits.cpu(), params)
    assert all(expected[i, t] > 0 for i, t in enumerate(out.token_ids))
    # A seeded row: the same token alone as in the batch, given the same number of draws.
    alone = Sampler("cuda", seed=1)
    gen = alone.new_generator(3)
    first = [sample(alone, logits[1:2], [params[1]], [gen])[0] for _ in range(2)]
    assert first[1] == out.token_ids[1]


def test_logit_bias_steers_choice_not_logprobs():
    vocab = 64
    logits = random_logits(83, 4, vocab)
    target = int(logits[0].argmin())
    banned = int(logits[1].argmax())
    params = [SamplingParams(temperature=0, logit_bias={target: 100.0}, logprobs=2),
              SamplingParams(temperature=0, logit_bias={banned: -100.0}),
              SamplingParams(temperature=1.0, seed=5, top_k=2, logit_bias={int(logits[2].argmax()): -100.0}),
              SamplingParams(temperature=0)]
    sampler = Sampler("cpu")
    before = logits.clone()
    out = sampler(logits, params, [None, None, sampler.new_generator(5), None])
    assert torch.equal(logits, before)
    assert out.token_ids[0] == target
    expected = logits[1].clone()
    expected[banned] = -math.inf
    assert out.token_ids[1] == int(expected.argmax())
    row2 = logits[2].clone()
    row2[int(logits[2].argmax())] = -math.inf
    second_best = set(torch.topk(row2, 2).indices.tolist())
    assert out.token_ids[2] in second_best                      # the banned token left the top 2
    assert out.token_ids[3] == int(logits[3].argmax())          # rows without bias are untouched
    raw = torch.log_softmax(logits[0].double(), dim=0)
    assert abs(out.logprobs[0].logprob - raw[target].item()) < 1e-5   # logprobs stay raw


@pytest.mark.parametrize("bias, message", [
    ({-1: 1.0}, "keys must be token ids"), ({"3": 1.0}, "keys must be token ids"),
    ({3: 101.0}, "logit_bias[3]"), ({3: math.nan}, "logit_bias[3]"), ([1, 2], "logit_bias"),
    ({i: 1.0 for i in range(301)}, "at most 300"),
])
def test_bad_logit_bias_names_the_entry(bias, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(logit_bias=bias)


def test_logit_bias_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="logit_bias has token id 70"):
        SamplingParams(logit_bias={70: 1.0}).check_vocab(64)

"""cluster/cost_model.py and cluster/simulator.py: the fit against known constants, step timing against a
plain loop, conservation of requests, and the policies' expected orderings on small traces."""
import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from loraplex.cluster.cost_model import AdapterLoadCost, StepCostModel, fit_cost_model
from loraplex.cluster.sim_replica import Macro, SimSeq
from loraplex.cluster.simulator import ClusterConfig, ClusterSim, make_trace, simulate

MODEL = StepCostModel(a=4.0, b=0.01, c=1.3e-4, d=0.026, e=1.1, p=0.021)
LOADS = AdapterLoadCost(host_to_gpu_s=0.01, disk_to_host_s=0.27)
SMALL = ClusterConfig(gpus=4, max_running=64, kv_blocks=4000, gpu_slots=32, cpu_slots=64)


def _write_results(root, m: StepCostModel, rng: random.Random) -> None:
    """Benchmark result files as the benchmarks write them, with times from `m` (attention: c per layer)."""
    layers = 32
    att = [{"kind": "decode", "model": "llama2-7b", "batch": b, "context": ctx,
            "graph_us": 1000 * (0.005 + m.c / layers * b * ctx)} for b in (32, 64, 128) for ctx in (512, 4096)]
    att.append({"kind": "decode", "model": "llama2-7b", "batch": 1, "context": 512, "graph_us": 99.0})  # ignored
    (root / "attention.json").write_text(json.dumps({"rows": att}))
    fwd = []
    for b in (1, 8, 32, 128):
        for v, d in (("backbone", 0), ("distinct", b), ("shared", 1)):
            fwd.append({"kind": "decode", "batch": b, "context": 512, "variant": v, "adapters_read": d,
                        "graph_us": 1000 * m.step_ms(b, b * 512, d)})
    for v, lora in (("backbone", 0), ("distinct", 1)):
        fwd.append({"kind": "prefill", "batch": 8, "context": 512, "variant": v,
                    "eager_us": 1000 * (m.a + m.e * lora + m.p * 4096)})
    (root / "model_forward.json").write_text(json.dumps({"layers": layers, "rows": fwd}))

    def engine_row(b, v, ctx):
        d = {"backbone": 0, "distinct": b, "shared": 1}[v]
        tokens, steps = rng.randint(1500, 2000) * 12, 12
        ms = m.a + (m.e if d else 0) + m.p * tokens / steps
        return {"batch": b, "mode": "graphs", "variant": v, "mean_full_context": ctx,
                "full_decode_step_ms": m.step_ms(b, round(b * ctx), d),
                "breakdown": {"mixed": {"steps": steps, "tokens": tokens, "seconds": ms * steps / 1000}}}
    rows = [engine_row(b, v, rng.uniform(300, 500)) for b in (32, 256) for v in ("backbone", "distinct", "shared")]
    rows.append(dict(rows[0], mode="eager", full_decode_step_ms=1e3))                 # eager rows are ignored
    (root / "engine.json").write_text(json.dumps({"rows": rows}))
    (root / "engine_b32").mkdir()
    for i in range(3):
        (root / "engine_b32" / f"process_{i}.json").write_text(json.dumps(
            {"rows": [engine_row(32, v, 400.0) for v in ("backbone", "distinct")]}))
    (root / "adapter_load.json").write_text(json.dumps({"h2d": {"gpu_ms_as_issued": 12.5},
                                                        "single": {"read_cold_ms": 250.0}}))


def test_the_fit_recovers_the_constants_that_made_the_measurements(tmp_path):
    rng = random.Random()
    truth = StepCostModel(a=rng.uniform(3, 6), b=rng.uniform(0.005, 0.02), c=rng.uniform(0.5e-4, 2e-4),
                          d=rng.uniform(0.01, 0.05), e=rng.uniform(0.5, 1.5), p=rng.uniform(0.015, 0.03))
    _write_results(tmp_path, truth, rng)
    fit = fit_cost_model(tmp_path)
    for name in ("a", "b", "c", "d", "e", "p"):
        assert getattr(fit.model, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert max(abs(r) for r in fit.decode_residuals) < 1e-6
    assert fit.loads == AdapterLoadCost(0.0125, 0.25)
    assert len(fit.decode_points) == 12 + 6 + 2          # forward, engine.json graphs, engine_b32 medians


def test_the_fit_to_the_shipped_results_is_within_a_millisecond():
    fit = fit_cost_model(Path(__file__).resolve().parent.parent / "benchmarks" / "results")
    assert max(abs(r) for r in fit.decode_residuals) < 1.5
    assert fit.model.c > 0 and fit.model.a > 0


def test_macro_step_times_match_a_step_by_step_loop():
    rng = random.Random()
    for _ in range(50):
        b, ctx0, k = rng.randint(1, 64), rng.randint(1, 5000), rng.randint(1, 300)
        m = Macro(t0=rng.uniform(0, 10), k=k, batch=b, ctx0=ctx0, per_step_s=rng.uniform(1e-3, 1e-2),
                  growth_s=rng.uniform(0, 1e-5), prefill_s=rng.uniform(0, 0.05))
        t, ends = m.t0, []
        for j in range(k):
            t += m.per_step_s + m.growth_s * j + (m.prefill_s if j == 0 else 0.0)
            ends.append(t)
        assert m.t0 + m.elapsed(k) == pytest.approx(ends[-1], rel=1e-12)
        probe = rng.uniform(m.t0, ends[-1])
        done = sum(e <= probe for e in ends)
        assert m.steps_by(probe, completed=True) == done
        assert m.steps_by(probe, completed=False) == min(k, done + (ends[done - 1] < probe if done else 1))


def test_requests_alone_on_one_gpu_take_the_cost_models_steps():
    """Requests arriving together for one adapter on one GPU: latencies from a plain float64 loop."""
    rng = random.Random()
    seqs = [SimSeq(i, 0.0, rng.randint(1, 200), rng.randint(1, 300), "lora0") for i in range(rng.randint(1, 5))]
    res_seqs = [SimSeq(s.index, s.arrival, s.prompt, s.output, s.adapter) for s in seqs]
    cfg = ClusterConfig(gpus=1, max_running=8, kv_blocks=10_000)
    ClusterSim(cfg, MODEL, LOADS, "consolidate").run(res_seqs)
    t = LOADS.load_s(in_host_memory=False)
    ctx = {s.index: s.prompt for s in seqs}
    left = {s.index: s.output for s in seqs}
    expect, first = {}, True
    while left:
        ms = MODEL.step_ms(len(left), sum(ctx[i] for i in left), 1, sum(ctx.values()) if first else 0)
        t += ms / 1000
        first = False
        for i in list(left):
            ctx[i] += 1
            left[i] -= 1
            if not left[i]:
                expect[i] = t
                del left[i]
    for s in res_seqs:
        assert s.finish == pytest.approx(expect[s.index], rel=1e-9)


def _run(cfg, policy, rate=2.0, n=120, popularity="uniform", seed=0):
    trace = make_trace(n, rate, popularity, seed=seed, max_len=1024)
    return simulate(trace, cfg, MODEL, LOADS, policy, rate=rate, popularity=popularity), trace


@pytest.mark.parametrize("policy", ["consolidate", "least_loaded", "round_robin"])
def test_every_request_finishes_exactly_once_even_when_moved(policy):
    trace = make_trace(150, 40.0, "skewed", seed=1, max_len=1024)
    tight = replace(SMALL, gpus=2, kv_blocks=300)                         # forces migrations and preemptions
    sim = ClusterSim(tight, MODEL, LOADS, policy)
    seqs = sim.run([SimSeq(s.index, s.arrival, s.prompt, s.output, s.adapter) for s in trace])
    assert all(s.finishes == 1 and s.generated == s.output for s in seqs)
    assert all(s.arrival < s.first_token <= s.finish for s in seqs)
    assert sim.migrations + sim.preemptions > 0
    assert all(not r.running and not r.waiting and sum(r.pins.values()) == 0 for r in sim.replicas)


def test_with_one_gpu_every_policy_gives_the_same_run():
    one = replace(SMALL, gpus=1)
    runs = [_run(one, p, rate=4.0)[0].to_json() for p in ("consolidate", "least_loaded", "round_robin")]
    for r in runs:
        r.pop("policy")
    assert runs[0] == runs[1] == runs[2]


def test_latency_grows_with_the_rate():
    runs = [_run(SMALL, "least_loaded", rate=rate, n=300)[0] for rate in (0.5, 10.0, 60.0)]
    for slow, fast in itertools.pairwise(runs):
        assert fast.latency_p50_s > 1.05 * slow.latency_p50_s
        assert fast.latency_p99_s > slow.latency_p99_s and fast.mean_batch > slow.mean_batch


def test_consolidation_uses_fewer_busy_seconds_than_least_loaded_at_light_load():
    cons, ll = _run(SMALL, "consolidate", rate=1.0)[0], _run(SMALL, "least_loaded", rate=1.0)[0]
    assert cons.finished == ll.finished == 120
    assert cons.busy_s_per_1k < 0.6 * ll.busy_s_per_1k
    assert cons.gpus_used < ll.gpus_used and cons.mean_batch > ll.mean_batch


def test_the_same_seed_gives_the_same_run_and_bad_settings_are_refused():
    assert _run(SMALL, "consolidate", seed=3)[0] == _run(SMALL, "consolidate", seed=3)[0]
    with pytest.raises(ValueError, match="rate"):
        make_trace(10, 0.0, "uniform")
    with pytest.raises(ValueError, match="popularity"):
        make_trace(10, 1.0, "identicalish")
    with pytest.raises(ValueError, match="kv_blocks"):
        ClusterConfig(kv_blocks=0)

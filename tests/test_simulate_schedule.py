"""bench/schedule.py and benchmarks/simulate_schedule.py: the scheduler alone on a workload, every adapter
resident from the start."""
import importlib.util
from pathlib import Path

import pytest

from loraplex.bench.ceiling import StepBytes, simulate_ceiling
from loraplex.bench.schedule import simulate_schedule
from loraplex.config import EngineConfig
from loraplex.bench.workload import make_workload
from loraplex.models.config import ModelConfig
from loraplex.models.presets import PRESETS

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture()
def sim():
    spec = importlib.util.spec_from_file_location("simulate_schedule", BENCHMARKS / "simulate_schedule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_request_runs_to_its_length_and_the_batch_follows_kv_memory():
    w = make_workload(40, "distinct", max_len=64, seed=3)
    config = EngineConfig(model="dummy:x", device="cpu", max_num_seqs=8, block_size=4)
    roomy = simulate_schedule(w, config, 1 << 14)
    tight = simulate_schedule(w, config, 64)
    # every output token is one logits row: steps x batch covers them (prompts add their first steps)
    for r in (roomy, tight):
        assert r["schedule_mean_batch"] * r["schedule_steps"] >= w.output_tokens and r["schedule_mean_batch"] <= 8
    assert roomy["schedule_mean_batch"] > tight["schedule_mean_batch"]
    assert roomy["schedule_steps"] < tight["schedule_steps"]
    assert roomy["schedule_preemptions"] == 0


def test_the_command_prints_the_schedule_of_a_kv_size(sim, capsys):
    result = sim.main(["--requests", "30", "--max-len", "64", "--kv-tokens", "4096", "--max-batch", "4"])
    assert result["max_batch"] == 4 and 0 < result["schedule_mean_batch"] <= 4
    assert "schedule_mean_batch" in capsys.readouterr().out


def test_kv_from_ceiling_inverts_the_ceiling_s_step_count(sim):
    w = make_workload(60, "distinct", max_len=128, seed=1)
    step_bytes = StepBytes.of(ModelConfig.from_dict(PRESETS["llama-2-7b"]), 16)
    steps = lambda kv: simulate_ceiling(w, step_bytes, 1.0, max_batch=None, kv_tokens=kv)["ceiling_steps"]  # noqa: E731
    target = steps(600)
    kv = sim.kv_from_ceiling(w, target, lo=128)
    assert steps(kv) <= target < steps(kv - 1)


def test_the_admission_lookahead_trades_a_little_batch_for_fewer_recomputed_tokens():
    """Where KV memory runs short, the adaptive lookahead (Scheduler._adapt_lookahead) preempts less and
    recomputes fewer tokens; where nothing was preempted, the schedule is the same."""
    w = make_workload(200, "distinct", max_len=512, seed=1)

    def run(blocks, lookahead):
        config = EngineConfig(model="dummy:x", device="cpu", max_num_seqs=128, block_size=16,
                              admission_lookahead=lookahead)
        return simulate_schedule(w, config, blocks)
    tight_off, tight_on = run(400, 0), run(400, 256)
    assert tight_off["schedule_preemptions"] > 2 * tight_on["schedule_preemptions"] > 0
    assert tight_off["schedule_recomputed_tokens"] > 2 * tight_on["schedule_recomputed_tokens"]
    assert tight_on["schedule_mean_batch"] < tight_off["schedule_mean_batch"]
    roomy_off, roomy_on = run(1600, 0), run(1600, 256)
    assert roomy_off["schedule_preemptions"] == 0 and roomy_on == roomy_off

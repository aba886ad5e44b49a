"""bench/schedule.py: the scheduler alone on a workload, every adapter resident from the start (the
`schedule_*` keys of `loraplex bench`'s rows)."""
from loraplex.bench.schedule import simulate_schedule
from loraplex.bench.workload import make_workload
from loraplex.config import EngineConfig


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


def test_the_admission_lookahead_trades_a_little_batch_for_fewer_recomputed_tokens():
    """Where KV memory runs short, the adaptive lookahead (Scheduler.note_step) preempts less and
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

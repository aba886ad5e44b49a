"""cluster/routing.py: each numbered rule of its docstring, then random replica sets against a plain-loop
oracle of the same rules."""
import math
import random

import pytest

from loraplex.cluster.routing import (
    OUTPUT_RESERVE,
    Policy,
    QueueFull,
    ReplicaStats,
    RoundRobinState,
    RouteRequest,
    RouterQueue,
    blocks_needed,
    choose_replica,
    has_room,
    with_request,
)


def rep(rid, **kw):
    base = {"running": 1, "max_running": 8, "free_kv_blocks": 100, "total_kv_blocks": 200, "block_size": 16,
            "free_gpu_slots": 2}
    base.update(kw)
    for k in ("gpu_adapters", "cpu_adapters"):
        if k in base:
            base[k] = frozenset(base[k])
    return ReplicaStats(rid, **base)


REQ = RouteRequest(("x",), prompt_tokens=40, max_new_tokens=30)


# rule 1: ready and not excluded
def test_rule1_not_ready_and_excluded_replicas_are_skipped():
    for policy in Policy:
        assert choose_replica(REQ, [rep("a", ready=False), rep("b", running=0)], policy) == "b"
        assert choose_replica(REQ, [rep("a", running=5), rep("b")], policy, exclude=frozenset({"a"})) == "b"
        assert choose_replica(REQ, [rep("a")], policy, exclude=frozenset({"a"})) is None


# rule 2a: seats
def test_rule2a_running_plus_waiting_must_leave_a_seat():
    assert not has_room(REQ, rep("a", running=6, waiting=2))
    assert has_room(REQ, rep("a", running=6, waiting=1))


# rule 2b: KV blocks, prompt whole, output by OUTPUT_RESERVE, ceil division
def test_rule2b_kv_blocks_count_the_prompt_and_a_fraction_of_the_output():
    rng = random.Random(7)
    for _ in range(50):
        p, n, bs = rng.randint(1, 500), rng.randint(0, 500), rng.choice([1, 8, 16, 32])
        req = RouteRequest((), p, n)
        need = math.ceil((p + math.ceil(OUTPUT_RESERVE * n)) / bs)
        assert blocks_needed(req, bs) == need
        assert has_room(req, rep("a", free_kv_blocks=need, block_size=bs))
        assert not has_room(req, rep("a", free_kv_blocks=need - 1, block_size=bs))
    assert blocks_needed(RouteRequest((), 16, 100), 16, output_reserve=1.0) == 8
    assert blocks_needed(RouteRequest((), 16, 100), 16, output_reserve=0.0) == 1


# rule 2c: adapters not on the GPU count against free slots
def test_rule2c_missing_members_need_free_gpu_slots():
    comp = RouteRequest(("x", "y", "z"), 10, 10)
    assert has_room(comp, rep("a", gpu_adapters={"x"}, free_gpu_slots=2))
    assert not has_room(comp, rep("a", gpu_adapters={"x"}, free_gpu_slots=1))
    assert has_room(comp, rep("a", gpu_adapters={"x", "y", "z"}, free_gpu_slots=0))
    assert has_room(RouteRequest((), 10, 10), rep("a", free_gpu_slots=0))
    assert not has_room(REQ, rep("a", free_gpu_slots=0, cpu_adapters={"x"}))


# rule 3: consolidation
def test_rule3_consolidate_prefers_holders_then_the_largest_batch():
    holder_small = rep("h", running=1, gpu_adapters={"x"})
    big = rep("b", running=6)
    assert choose_replica(REQ, [holder_small, big]) == "h"           # a holder wins over a bigger batch
    holder_big = rep("i", running=4, gpu_adapters={"x"})
    assert choose_replica(REQ, [holder_small, holder_big, big]) == "i"
    full_holder = rep("f", running=8, gpu_adapters={"x"})
    assert choose_replica(REQ, [full_holder, big, rep("c", running=2)]) == "b"  # no holder has room
    # ties: host memory copy, then fewest free blocks, then id
    assert choose_replica(REQ, [rep("a", running=3), rep("b", running=3, cpu_adapters={"x"})]) == "b"
    assert choose_replica(REQ, [rep("a", running=3, free_kv_blocks=90), rep("b", running=3,
                                                                            free_kv_blocks=50)]) == "b"
    assert choose_replica(REQ, [rep("b", running=3), rep("a", running=3)]) == "a"
    base = RouteRequest((), 40, 30)
    assert choose_replica(base, [rep("a", running=2), rep("b", running=5, free_gpu_slots=0)]) == "b"


def test_rule3_a_batch_target_spills_consolidation_then_spreads():
    reps = [rep("a", running=5, gpu_adapters={"x"}), rep("b", running=3), rep("c", running=1, waiting=1)]
    assert choose_replica(REQ, reps, target_batch=None) == "a"
    assert choose_replica(REQ, reps, target_batch=5) == "b"            # a reached it; b is the fullest below
    assert choose_replica(REQ, reps, target_batch=2) == "c"            # all reached it: least loaded
    with pytest.raises(ValueError, match="target_batch"):
        choose_replica(REQ, reps, target_batch=0)


# rule 4: least loaded
def test_rule4_least_loaded_counts_running_and_waiting_with_affinity_as_tie_break():
    assert choose_replica(REQ, [rep("a", running=1, waiting=3), rep("b", running=3)], Policy.LEAST_LOADED) == "b"
    assert choose_replica(REQ, [rep("a", running=2), rep("b", running=2, gpu_adapters={"x"})],
                          Policy.LEAST_LOADED) == "b"
    assert choose_replica(REQ, [rep("a", running=1), rep("b", running=2, gpu_adapters={"x"})],
                          Policy.LEAST_LOADED) == "a"
    assert choose_replica(REQ, [rep("a", running=2, free_kv_blocks=20), rep("b", running=2, free_kv_blocks=30)],
                          Policy.LEAST_LOADED) == "b"


# rule 5: round robin
def test_rule5_round_robin_takes_replicas_in_turn_skipping_those_without_room():
    reps = [rep("c"), rep("a"), rep("b", running=8), rep("d")]
    state = RoundRobinState()
    got = [choose_replica(REQ, reps, Policy.ROUND_ROBIN, rr_state=state) for _ in range(6)]
    assert got == ["a", "c", "d", "a", "c", "d"]
    assert choose_replica(REQ, reps, Policy.ROUND_ROBIN) == "a"


# rule 6: nobody has room
def test_rule6_none_when_no_replica_has_room():
    reps = [rep("a", running=8), rep("b", free_kv_blocks=2), rep("c", free_gpu_slots=0)]
    for policy in Policy:
        assert choose_replica(REQ, reps, policy) is None
    assert choose_replica(REQ, [], Policy.CONSOLIDATE) is None


# rule 7: the router queue
def test_rule7_queue_is_bounded_fifo_and_ages_its_head():
    q = RouterQueue(max_waiting=3, max_head_skips=1)
    for i in range(3):
        q.push(i)
    with pytest.raises(QueueFull, match="3 requests"):
        q.push(3)
    assert q.pop_ready(lambda i: "r" if i == 1 else None) == [(1, "r")]   # head 0 passed over once
    assert list(q) == [0, 2]
    assert q.pop_ready(lambda i: "r" if i == 2 else None) == []           # aged: nothing passes it now
    assert q.pop_ready(lambda i: "r") == [(0, "r"), (2, "r")] and len(q) == 0
    strict = RouterQueue(max_waiting=4, max_head_skips=0)
    for i in range(3):
        strict.push(i)
    assert strict.pop_ready(lambda i: None if i == 0 else "r") == []
    assert strict.remove(0) and not strict.remove(0)
    assert strict.pop_ready(lambda i: "r") == [(1, "r"), (2, "r")]


def test_with_request_takes_blocks_seats_and_slots():
    r = rep("a", running=2, free_kv_blocks=10, free_gpu_slots=1, gpu_adapters={"y"})
    after = with_request(r, RouteRequest(("x", "y"), 32, 0))
    assert (after.waiting, after.free_kv_blocks, after.free_gpu_slots) == (1, 8, 0)
    assert after.gpu_adapters == {"x", "y"}


def test_bad_inputs_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="running"):
        ReplicaStats("a", running=-1)
    with pytest.raises(ValueError, match="max_running"):
        ReplicaStats("a", max_running=0)
    with pytest.raises(ValueError, match="block_size"):
        ReplicaStats("a", block_size=0)
    with pytest.raises(ValueError, match="prompt_tokens"):
        RouteRequest((), -1, 0)
    with pytest.raises(ValueError, match="policy"):
        choose_replica(REQ, [rep("a")], "fastest")
    with pytest.raises(ValueError, match="unique"):
        choose_replica(REQ, [rep("a"), rep("a")])
    with pytest.raises(ValueError, match="max_waiting"):
        RouterQueue(max_waiting=-1)


def _oracle(req, reps, policy, last, target=None):
    """The rules as plain loops: rooms, then a policy's ordering, spelled out."""
    room = []
    for r in reps:
        tokens = req.prompt_tokens + math.ceil(OUTPUT_RESERVE * req.max_new_tokens)
        missing = [a for a in set(req.adapters) if a not in r.gpu_adapters]
        if (r.ready and r.running + r.waiting < r.max_running and r.free_kv_blocks * r.block_size >= tokens
                and len(missing) <= r.free_gpu_slots):
            room.append((r, len(missing), len([a for a in missing if a in r.cpu_adapters])))
    if not room:
        return None
    if policy is Policy.ROUND_ROBIN:
        ids = sorted(r.replica_id for r, _, _ in room)
        later = [i for i in ids if last is None or i > last]
        return later[0] if later else ids[0]
    if policy is Policy.CONSOLIDATE and target is not None:
        below = [x for x in room if x[0].running + x[0].waiting < target]
        room, policy = (below, policy) if below else (room, Policy.LEAST_LOADED)
    best = None
    for r, miss, cpu in room:
        if policy is Policy.CONSOLIDATE:
            key = (miss > 0, -r.running, -cpu, r.free_kv_blocks, r.replica_id)
        else:
            key = (r.running + r.waiting, miss, -cpu, -r.free_kv_blocks, r.replica_id)
        if best is None or key < best[0]:
            best = (key, r.replica_id)
    return best[1]


def test_random_replica_sets_match_the_oracle():
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    names = [f"a{i}" for i in range(6)]
    for _ in range(400):
        reps = [ReplicaStats(f"r{i}", ready=rng.random() > 0.1, running=rng.randint(0, 8), waiting=rng.randint(0, 2),
                             max_running=8, free_kv_blocks=rng.randint(0, 40), block_size=rng.choice([4, 16]),
                             free_gpu_slots=rng.randint(0, 2),
                             gpu_adapters=frozenset(rng.sample(names, rng.randint(0, 3))),
                             cpu_adapters=frozenset(rng.sample(names, rng.randint(0, 3))))
                for i in rng.sample(range(9), rng.randint(1, 5))]
        req = RouteRequest(tuple(rng.sample(names, rng.randint(0, 2))), rng.randint(1, 200), rng.randint(0, 200))
        policy = rng.choice(list(Policy))
        last = rng.choice([None, "r3", "r9"])
        target = rng.choice([None, 2, 5])
        got = choose_replica(req, reps, policy, rr_state=RoundRobinState(last), target_batch=target)
        assert got == _oracle(req, reps, policy, last, target), (seed, req, reps, policy, target)

"""loraplex's Ray Serve application (src/loraplex/cluster/) on a local Ray cluster of CPU replicas of the shipped
demo model: routing (adapter affinity, consolidation, the router queue's bound), migration and failover with the
greedy output of an undisturbed run as the oracle, adapter registration reaching every replica, and the official
openai client against the ingress. The engine-level pieces (resume, migration) are checked first without Ray.

The cluster starts once for the module (tests/cluster_fixtures.py); the test that kills a replica runs last."""
from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loraplex.cluster.routing import RouteRequest, blocks_needed
from loraplex.demo.assets import demo_adapters, demo_model_dir
from loraplex.sampling import SamplingParams

# freeze_gc_heap off: the engines made in this process are not closed, and a freeze they held would outlive them
# (tests/test_engine.py measures the heap's freeze)
CPU_ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=8,
                  max_num_batched_tokens=64, max_model_len=256, freeze_gc_heap=False)
WORDS = ["The", "river", "a", "house", "of", "green", "light", "when", "she", "said", "old", "map"]


def _prompt(rng: random.Random, n: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ---- without Ray: the replica's engine ------------------------------------------------------------
@pytest.fixture
def one_thread():
    """One intra-op thread while these engines run here: on a small shared machine, OpenMP teams of two spin
    against each other and slow the CPU reference ops many times over (the replicas run with one, as Ray sets)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(engine, requests, params) -> dict:
    for rid, prompt, adapter in requests:
        engine.add_request(rid, prompt, params, adapter)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_migration_then_resume_equals_an_undisturbed_run(one_thread):
    """A replica short of KV blocks gives requests away (MIGRATED) instead of preempting them; another resumes them
    from prompt + tokens so far: tokens and text equal a run with memory to spare."""
    from loraplex.cluster.replica_engine import ReplicaEngine, Resumed
    from loraplex.config import EngineConfig
    from loraplex.engine.engine import Engine

    rng = random.Random()
    params = SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True)
    requests = [(f"r{i}", _prompt(rng, rng.randint(3, 8)), a) for i, a in enumerate([None, "python", "docs"])]
    config = EngineConfig(str(demo_model_dir()), **CPU_ENGINE)
    reference = _run(Engine(config, demo_adapters()), requests, params)
    short = ReplicaEngine(config, demo_adapters())
    assert short.hold_kv_blocks(64 - 12) == 52
    short.peers.set([64])
    first = _run(short, requests, params)
    moved = {rid for rid, out in first.items() if out.finish_reason == "migrated"}
    assert moved and short.num_migrations == len(moved) and short.scheduler.num_preemptions == 0
    other = ReplicaEngine(config, demo_adapters())
    resumed = _run(other, [(rid, Resumed(first[rid].prompt_token_ids, first[rid].token_ids), a)
                           for rid, _, a in requests if rid in moved], params)
    for rid, _, _ in requests:
        if rid not in moved:
            assert first[rid].token_ids == reference[rid].token_ids
            continue
        before, after = first[rid], resumed[rid]
        assert after.token_ids[:len(before.token_ids)] == before.token_ids   # the resumed output carries them
        assert after.token_ids == reference[rid].token_ids, rid
        assert after.text == reference[rid].text and after.text.startswith(before.text)
        assert after.finish_reason == "length"


def test_no_peer_room_preempts_as_usual(one_thread):
    from loraplex.cluster.replica_engine import ReplicaEngine
    from loraplex.config import EngineConfig

    engine = ReplicaEngine(EngineConfig(str(demo_model_dir()), **CPU_ENGINE))
    engine.hold_kv_blocks(64 - 10)
    engine.peers.set([3])   # too few blocks anywhere else
    done = _run(engine, [(f"r{i}", "The river and the old", None) for i in range(3)],
                SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert {o.finish_reason for o in done.values()} == {"length"}
    assert engine.num_migrations == 0 and engine.scheduler.num_preemptions > 0


def test_view_counts_jobs_sent_until_reported():
    from loraplex.cluster.view import ClusterView
    view = ClusterView(origin="ingress")
    report = dict(ready=True, running=0, waiting=0, max_running=4, free_kv_blocks=64, total_kv_blocks=64,
                  block_size=8, free_gpu_slots=1, gpu_adapters=[], cpu_adapters=[], received={}, ended={})
    view.update({"a": report, "b": report})
    route = RouteRequest(("python",), prompt_tokens=9, max_new_tokens=14)
    first = view.choose(route)
    view.note_sent(first, "job-1", route)
    stats = {s.replica_id: s for s in view.stats()}
    assert stats[first].waiting == 1 and stats[first].free_kv_blocks == 64 - blocks_needed(route, 8)
    assert stats[first].gpu_adapters == {"python"} and stats[first].free_gpu_slots == 0
    view.note_sent(first, "job-1", route)   # the same job again: counted once
    assert {s.replica_id: s for s in view.stats()}[first].waiting == 1
    view.update({"a": dict(report, received={"ingress": 1}), "b": dict(report, received={"ingress": 1})})
    assert {s.replica_id: s for s in view.stats()}[first].waiting == 0   # now in the report itself
    view.mark_failed(first)
    assert view.choose(route) not in (first, None)


def test_view_counts_the_slot_a_resident_adapter_will_pin():
    """A request for an adapter on the GPU but held by no request pins its slot once it runs: the next request,
    for another adapter, must not count that slot as free."""
    from loraplex.cluster.view import ClusterView
    view = ClusterView(origin="ingress")
    report = dict(ready=True, running=0, waiting=0, max_running=4, free_kv_blocks=64, total_kv_blocks=64,
                  block_size=8, free_gpu_slots=1, gpu_adapters=["python"], cpu_adapters=[], running_adapters=[],
                  waiting_adapters=[], received={}, ended={})
    view.update({"a": report, "b": dict(report, gpu_adapters=[])})
    python = RouteRequest(("python",), prompt_tokens=5, max_new_tokens=8)
    assert view.choose(python) == "a"            # affinity: it holds python
    view.note_sent("a", "job-1", python)
    docs = RouteRequest(("docs",), prompt_tokens=5, max_new_tokens=8)
    assert view.choose(docs) == "b"              # a's only slot is python's now
    view.update({"a": dict(report, waiting=1, waiting_adapters=["python"], free_gpu_slots=0,
                           received={"ingress": 1}), "b": dict(report, gpu_adapters=[])})
    assert view.choose(docs) == "b" and view.choose(python) == "a"


def test_example_serve_config_is_valid_options():
    import yaml
    from loraplex.cluster.options import ClusterOptions
    config = yaml.safe_load((Path(__file__).parents[1] / "examples" / "serve_config.yaml").read_text())
    (app,) = config["applications"]
    assert app["import_path"] == "loraplex.cluster.app:build_app"
    options = ClusterOptions.from_args(app["args"])
    assert options.replicas == 4 and options.engine["model"] == "/models/Llama-3-8B"
    with pytest.raises(ValueError, match="unknown argument.*replica_count"):
        ClusterOptions.from_args({"replica_count": 2})
    with pytest.raises(ValueError, match="policy must be one of"):
        ClusterOptions.from_args({"policy": "fastest"})
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        ClusterOptions.from_args({"replicas": 0})


def test_serve_without_replicas_needs_no_ray(tmp_path):
    """`loraplex serve` alone never imports Ray; the cluster flags need --replicas."""
    code = ("import sys; from loraplex.cli import main; import loraplex.server.serve; "
            "code = main(['serve', '--router-queue', '3']); "
            "assert code == 2, code; assert 'ray' not in sys.modules, 'ray imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "go with --replicas" in run.stderr


# ---- on a local Ray cluster -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    pytest.importorskip("ray.serve")
    from cluster_fixtures import RayCluster
    c = RayCluster(tmp_path_factory.mktemp("cluster"))
    yield c
    c.close()


def _complete(cluster, model: str, prompt: str, max_tokens: int, **extra) -> dict:
    r = cluster.http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                    "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


async def _stream_text(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, on_chunk=None):
    """(status, text) of a streamed completion; `on_chunk(i)` after each chunk with text."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode()
        text, i = "", 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
                i += 1
                if on_chunk is not None:
                    await on_chunk(i)
        return 200, text


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def test_openai_client_against_the_ray_ingress(cluster):
    import openai
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="none")
    assert {m.id for m in client.models.list().data} >= {"loraplex-demo", "python", "docs"}
    r = client.completions.create(model="python", prompt="def ", max_tokens=6, temperature=0)
    assert r.usage.completion_tokens == 6 and r.choices[0].text
    stream = client.chat.completions.create(model="loraplex-demo", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert pieces
    with pytest.raises(openai.NotFoundError):   # the server's own checks, at the ingress
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    ready = cluster.metric("loraplex_replica_ready")   # per replica, beside the aggregated series
    assert sorted(dict(k)["replica"] for k in ready) == sorted(cluster.reports()) and set(ready.values()) == {1.0}
    assert cluster.metric("loraplex_adapters", tier="disk")


def test_consolidation_keeps_a_light_load_on_one_replica(cluster):
    """Punica's consolidation: concurrent requests go to the replica with the largest batch that still has room."""
    rng = random.Random()
    before = cluster.served_by_replica()

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            return await asyncio.gather(*(_stream_text(client, "loraplex-demo", _prompt(rng), 12) for _ in range(3)))

    assert all(status == 200 for status, _ in asyncio.run(main()))
    cluster.wait(lambda: sum(_delta(cluster.served_by_replica(), before).values()) == 3, "three requests counted")
    assert len(_delta(cluster.served_by_replica(), before)) == 1   # all three on one replica


def test_adapter_affinity(cluster):
    """With one adapter slot per replica: while `python` is pinned on one replica, `docs` goes to the other; then
    each adapter's requests keep going where it is resident."""
    rng = random.Random()
    before = cluster.served_by_replica()

    async def two_long():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            started = asyncio.Event()

            async def first_chunk(i):
                started.set()

            python = asyncio.create_task(_stream_text(client, "python", "def ", 16, first_chunk))
            await started.wait()   # running, its adapter pinned in the replica's only slot
            return await asyncio.gather(python, _stream_text(client, "docs", _prompt(rng), 4))

    assert all(status == 200 for status, _ in asyncio.run(two_long()))
    cluster.wait(lambda: sum(_delta(cluster.served_by_replica(), before).values()) == 2, "two requests counted")
    placed = _delta(cluster.served_by_replica(), before)
    assert len(placed) == 2   # one replica each
    for model in ["python", "docs", "python", "docs"]:
        start = cluster.served_by_replica()
        _complete(cluster, model, _prompt(rng), 2)
        cluster.wait(lambda: sum(_delta(cluster.served_by_replica(), start).values()) == 1, "the request counted")
        (replica,) = _delta(cluster.served_by_replica(), start)
        home = [rid for rid, r in cluster.reports().items() if model in r["gpu_adapters"]]
        assert home == [replica], (model, replica, home)


def test_request_router_places_a_job_by_the_policy(cluster):
    """Ray's request router of this process, given a job that names no replica, chooses by routing.choose_replica:
    the replica that holds the job's adapter."""
    from loraplex.cluster.messages import Job
    (home,) = [rid for rid, r in cluster.reports().items() if "python" in r["gpu_adapters"]]
    job = Job(key="test-job-1", origin="test", prompt=(1, 260, 300, 41), params=SamplingParams(max_tokens=3),
              adapter="python", route=RouteRequest(("python",), 4, 3))
    items = list(cluster.handle.options(stream=True).generate.remote(job))
    assert items[0] == home
    assert items[-1].finished and items[-1].finish_reason == "length" and len(items[-1].token_ids) == 3


def test_router_queue_bound_is_429(cluster):
    """No replica has room (their KV blocks held): `router_queue` requests wait at the router, the next one gets
    429 naming the queue; once room returns the waiting ones complete."""
    rng = random.Random()
    replicas = sorted(cluster.reports())
    cluster.hold({rid: 64 for rid in replicas})
    try:
        async def main():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
                waiting = [asyncio.create_task(_stream_text(client, "loraplex-demo", _prompt(rng), 4))
                           for _ in range(2)]
                await asyncio.sleep(0.5)
                assert not any(t.done() for t in waiting)
                refused = await client.post("/v1/completions", json={"model": "loraplex-demo", "prompt": "The",
                                                                      "max_tokens": 4})
                assert refused.status_code == 429, refused.text
                assert "router queue is full" in refused.json()["error"]["message"]
                assert refused.headers["retry-after"] == "1"
                await asyncio.to_thread(cluster.hold, {rid: 0 for rid in replicas})
                return await asyncio.gather(*waiting)

        results = asyncio.run(main())
    finally:
        cluster.hold({rid: 0 for rid in replicas})
    assert [status for status, _ in results] == [200, 200] and all(text for _, text in results)
    assert sum(cluster.metric("loraplex_router_rejected_total").values()) >= 1


def test_migration_keeps_the_stream_and_the_greedy_output(cluster):
    """One replica keeps few KV blocks: its requests outgrow them and move to the other replica by re-prefill; the
    clients' streams go on, and the text equals that of the same requests with memory to spare."""
    rng = random.Random()
    prompts = [_prompt(rng, rng.randint(4, 8)) for _ in range(3)]
    reference = [_complete(cluster, "loraplex-demo", p, 40)["choices"][0]["text"] for p in prompts]
    short, roomy = sorted(cluster.reports())
    before = sum(cluster.metric("loraplex_migrations_total").values())
    # the references' replica reported idle first: consolidation sends new requests to a busy replica, which a
    # late report would make of the roomy one, and none would reach the short one
    cluster.wait(lambda: all(r["running"] == 0 and r["waiting"] == 0 for r in cluster.reports().values()),
                 "every replica idle")
    cluster.hold({short: 64 - 12, roomy: 0})   # 12 blocks of 8 tokens: three prompts, not their 40 tokens each
    # ...and in the ingress's own view (its gauges), which the router chooses from and which tells the short replica
    # its peer's room: on a loaded machine it can lag the reports read here by seconds
    cluster.wait(lambda: all(set(cluster.metric(f"loraplex_replica_num_requests_{g}").values()) == {0.0}
                             for g in ("running", "waiting")), "every replica idle in the ingress's view")
    # ...and the short replica told the roomy one's free blocks (the ingress's rounds of peer rooms, upkeep.py)
    cluster.wait(lambda: (r := cluster.reports())[short]["peer_free_kv_blocks"] == [r[roomy]["free_kv_blocks"]],
                 "the short replica knows its peer's room")
    try:
        async def main():
            async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
                return await asyncio.gather(*(_stream_text(client, "loraplex-demo", p, 40) for p in prompts))

        results = asyncio.run(main())
    finally:
        cluster.hold({short: 0})
    assert [status for status, _ in results] == [200] * 3
    assert [text for _, text in results] == reference
    cluster.wait(lambda: sum(cluster.metric("loraplex_migrations_total").values()) > before, "a migration counted")
    assert sum(cluster.metric("loraplex_migrations_total", replica=short).values()) >= 1


def test_adapter_registration_reaches_every_replica(cluster):
    replicas = sorted(cluster.reports())
    r = cluster.http.post("/v1/adapters", json={"name": "spare", "path": "spare"})
    assert r.status_code == 200, r.text
    assert all("spare" in cluster.adapters_on(rid) for rid in replicas)   # when the POST returns
    assert _complete(cluster, "spare", "A ", 4)["choices"][0]["text"]
    r = cluster.http.post("/v1/load_lora_adapter", json={"lora_name": "spare2", "lora_path": "spare"})
    assert r.status_code == 200 and "spare2" in r.text
    assert all("spare2" in cluster.adapters_on(rid) for rid in replicas)
    assert cluster.http.post("/v1/adapters", json={"name": "spare", "path": "spare"}).status_code == 409
    assert cluster.http.delete("/v1/adapters/spare").status_code == 200
    cluster.wait(lambda: all("spare" not in cluster.adapters_on(rid) for rid in replicas), "spare removed everywhere")
    gone = cluster.http.post("/v1/completions", json={"model": "spare", "prompt": "A", "max_tokens": 2})
    assert gone.status_code == 404
    assert "spare2" in {m["id"] for m in cluster.http.get("/v1/models").json()["data"]}


def test_a_replica_killed_mid_stream_loses_no_request(cluster):
    """SIGKILL the replica serving a stream and a whole request: both finish on the other replica, resumed by
    re-prefill, with the text of an undisturbed run; Ray starts a new replica, which gets the run-time adapters
    before it is routed to. (Last: the cluster is one replica short until then.)"""
    rng = random.Random()
    prompts = [_prompt(rng), _prompt(rng)]
    reference = [_complete(cluster, "loraplex-demo", p, 48)["choices"][0]["text"] for p in prompts]
    before = sum(cluster.metric("loraplex_retries_total").values())
    survivors = set(cluster.reports())

    async def main():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            killed: list[str] = []

            def busy() -> list[str]:
                return [rid for rid, r in cluster.reports().items() if r["running"] > 0]

            async def kill_once(i):
                if i == 4 and not killed:   # a few tokens in: kill the replica running it
                    cluster.wait(busy, "a replica reporting the requests running", timeout=10)
                    killed.append(busy()[0])
                    cluster.kill(killed[0])

            whole = asyncio.create_task(client.post("/v1/completions", json={
                "model": "loraplex-demo", "prompt": prompts[1], "max_tokens": 48, "temperature": 0,
                "ignore_eos": True}))
            streamed = await _stream_text(client, "loraplex-demo", prompts[0], 48, kill_once)
            return streamed, await whole, killed

    (status, text), whole, killed = asyncio.run(main())
    assert killed and status == 200 and text == reference[0]
    assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == reference[1]
    assert sum(cluster.metric("loraplex_retries_total").values()) >= before + 1
    # Ray replaces it; the ingress pushes the run-time adapters (spare2) before routing to it
    cluster.wait(lambda: len(set(cluster.reports()) - survivors) == 1, "a new replica", timeout=90)
    (new,) = set(cluster.reports()) - survivors
    cluster.wait(lambda: "spare2" in cluster.adapters_on(new), "spare2 on the new replica", timeout=90)

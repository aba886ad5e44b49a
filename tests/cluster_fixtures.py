"""A local Ray cluster serving loraplex's Ray Serve application (cluster/app.py) with CPU replicas of the shipped
demo model, for tests/test_cluster_ray.py: `RayCluster` starts it once per module and offers what the tests look at
from outside: the HTTP API, the replicas' reports (through a deployment handle of the test process, whose request
router sees the same reports as the ingress's), control calls to one replica, and /metrics."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from pathlib import Path

import httpx

APP = "loraplex"
REPLICAS = 2
# small and quick on the CPU; one adapter slot per replica, so that slots decide where adapters go
ENGINE = dict(device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=4,
              max_num_batched_tokens=64, max_model_len=256, max_gpu_adapters=1, max_lora_rank=16)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    def __init__(self, root: Path, router_queue: int = 2) -> None:
        import ray
        from ray import serve

        from loraplex.cluster.app import build_app
        from loraplex.demo.assets import demo_adapters

        self.roots = root / "adapters"
        self.roots.mkdir(parents=True)
        shutil.copytree(demo_adapters()["fortune"], self.roots / "spare")   # registered at run time
        ray.init(num_cpus=2 * REPLICAS + 2, include_dashboard=False, log_to_driver=False)
        self.port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})
        args = {"replicas": REPLICAS, "engine": ENGINE, "router_queue": router_queue, "stats_period_s": 0.1,
                "server": {"adapter_roots": [str(self.roots)], "log_level": "warning"}}
        serve.run(build_app(args), name=APP, route_prefix="/")
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.handle = serve.get_deployment_handle("EngineReplica", app_name=APP)
        self.handle.describe.remote().result()   # starts this process's request router (its view of the reports)
        self.wait(lambda: len(self.reports()) == REPLICAS and all(r.get("ready") for r in self.reports().values()),
                  "every replica reporting ready")

    def close(self) -> None:
        import ray
        self.http.close()
        # ray.shutdown ends every process of the cluster this started; serve.shutdown first would only add the
        # replicas' graceful drain (seconds), which no test looks at
        ray.shutdown()

    # ---- looking at the replicas ------------------------------------------------------------------
    def reports(self) -> dict[str, dict]:
        from loraplex.cluster.view import view_for
        return view_for(APP, "EngineReplica").reports()

    def control(self, replica_id: str, op: str, args=None):
        from loraplex.cluster.messages import Control
        return self.handle.control.remote(Control(replica_id, op, args)).result(timeout_s=60)

    def adapters_on(self, replica_id: str) -> set[str]:
        return set(self.control(replica_id, "describe")["specs"])

    def hold(self, blocks: dict[str, int]) -> None:
        """Hold KV blocks on replicas (0 gives them back), and wait until the reports show it."""
        for rid, count in blocks.items():
            self.control(rid, "hold_kv_blocks", count)
        total = ENGINE["num_kv_blocks"]
        self.wait(lambda: all(self.reports()[rid]["total_kv_blocks"] == total - count
                              for rid, count in blocks.items()), "the held KV blocks reported")
        time.sleep(0.3)   # the ingress gets the same reports through Ray a moment apart

    def kill(self, replica_id: str) -> None:
        os.kill(self.reports()[replica_id]["pid"], signal.SIGKILL)

    # ---- metrics ----------------------------------------------------------------------------------
    def metric(self, name: str, **labels: str) -> dict[tuple, float]:
        """Samples of `name` whose labels include `labels`: {sorted label items: value}."""
        from prometheus_client.parser import text_string_to_metric_families
        out = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    out[tuple(sorted(sample.labels.items()))] = sample.value
        return out

    def served_by_replica(self) -> dict[str, float]:
        """Attempts that ended with stop or length, per replica."""
        counts: dict[str, float] = {}
        for outcome in ("stop", "length"):
            for labels, value in self.metric("loraplex_replica_requests_total", outcome=outcome).items():
                rid = dict(labels)["replica"]
                counts[rid] = counts.get(rid, 0) + value
        return counts

    @staticmethod
    def wait(predicate, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if predicate():
                    return
            except (KeyError, httpx.HTTPError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout:.0f} s for {what}")
            time.sleep(0.05)

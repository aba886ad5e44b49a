"""`ServerMetrics`: the Prometheus series behind `GET /metrics`.

Two families live here:
- `loraplex_*`: our own counters, histograms and gauges, labelled by what a request named (an adapter, a named
  composition, "composed" for the `adapters` field, "base"; capped, see `adapter_label`); requests by each adapter
  they ran with (`loraplex_adapter_requests_total`: a composed request counts once for each member); and per-tenant
  request and token counters (`loraplex_tenant_*`, labelled by the tenant's name in the keys
  file: "none" for callers with no tenant, "other" past `max_tenant_labels` names);
- `vllm:*`: the few gauges that the Kubernetes Gateway API Inference Extension scrapes by default from
  vLLM-style servers (queue length, KV cache usage, LoRA affinity), so loraplex drops in behind that gateway.

Threads: `set_engine` and `observe_step` run on the engine thread, the rest on the HTTP event loop.
prometheus_client objects lock themselves; the state we add (the label map, the LoRA info sample) has its own lock.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

BASE_LABEL = "base"       # the base model (no adapter)
OTHER_LABEL = "other"     # every adapter (or tenant) past the label cap
NO_TENANT_LABEL = "none"  # requests with no tenant (--api-key, the admin key, an open server)
COMPOSED_LABEL = "composed"   # requests composing adapters with the `adapters` field (by member: adapter_requests)

OUTCOMES = ("stop", "length", "abort", "error")
TIERS = ("gpu", "cpu", "disk", "loading", "failed")
LOAD_STAGES = ("register", "disk", "slot_wait", "copy_issue", "gpu")

# Buckets sized for LLM serving: TTFT from a warm decode batch to a long prefill behind a queue, TPOT from a
# fast GPU to a crowded batch, end-to-end up to ten-minute generations.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0)
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STEP_TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(14))   # 1 .. 8192
STEP_SEQ_BUCKETS = tuple(float(2 ** i) for i in range(11))     # 1 .. 1024

LORA_INFO_NAME = "vllm:lora_requests_info"
LORA_INFO_LABELS = ("running_lora_adapters", "waiting_lora_adapters", "max_lora")


@dataclass
class EngineSnapshot:
    """The engine's state, read on the engine's own thread (the app never touches the engine directly)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    running_adapters: list[str]        # distinct adapter names of running requests
    waiting_adapters: list[str]        # distinct adapter names of waiting requests
    adapters_by_tier: dict[str, int]   # keys among TIERS -> count
    max_gpu_adapters: int              # = max LoRA adapters in one batch

    def __post_init__(self) -> None:
        for name in ("num_running", "num_waiting", "kv_blocks_used", "kv_blocks_total", "max_gpu_adapters"):
            _check_count(f"EngineSnapshot.{name}", getattr(self, name))
        if self.kv_blocks_used > self.kv_blocks_total:
            raise ValueError(f"EngineSnapshot.kv_blocks_used ({self.kv_blocks_used}) exceeds "
                             f"kv_blocks_total ({self.kv_blocks_total})")
        for tier, count in self.adapters_by_tier.items():
            if tier not in TIERS:
                raise ValueError(f"EngineSnapshot.adapters_by_tier: unknown tier {tier!r}, expected one of {TIERS}")
            _check_count(f"EngineSnapshot.adapters_by_tier[{tier!r}]", count)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (0 when there are no blocks)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def _check_count(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")


def _check_seconds(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")


def _adapter_list(names: list[str]) -> str:
    """vLLM's label format: comma-joined adapter names; sorted so equal sets give equal labels."""
    return ",".join(sorted({n for n in names if n}))


class _LoraInfoCollector:
    """Exposes `vllm:lora_requests_info`: exactly one sample, whose labels name the running and waiting
    adapters and whose value is the unix time of the snapshot (the gateway keeps the sample with the largest
    value). A custom collector rather than a labelled Gauge so that swapping the label set is atomic: a scrape
    never sees zero or two samples."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sample: tuple[dict[str, str], float] | None = None   # None until the first snapshot

    def update(self, running: str, waiting: str, max_lora: int, now: float) -> None:
        labels = dict(zip(LORA_INFO_LABELS, (running, waiting, str(max_lora))))
        with self._lock:
            self._sample = (labels, now)

    def describe(self) -> list[Metric]:
        # Lets the registry catch name clashes without calling collect().
        return [GaugeMetricFamily(LORA_INFO_NAME, "", labels=LORA_INFO_LABELS)]

    def collect(self) -> list[Metric]:
        family = GaugeMetricFamily(LORA_INFO_NAME, "Running and waiting LoRA adapters; the value is the unix time "
                                   "of this report", labels=LORA_INFO_LABELS)
        with self._lock:
            sample = self._sample
        if sample is not None:
            labels, value = sample
            family.add_metric([labels[k] for k in LORA_INFO_LABELS], value)
        return [family]


class ServerMetrics:
    """Every series the server exports, in one registry (private by default, so several can coexist)."""

    def __init__(self, *, max_adapter_labels: int = 100, max_tenant_labels: int = 100,
                 registry: CollectorRegistry | None = None) -> None:
        for name, value in (("max_adapter_labels", max_adapter_labels), ("max_tenant_labels", max_tenant_labels)):
            _check_count(name, value)
        self.max_adapter_labels, self.max_tenant_labels = max_adapter_labels, max_tenant_labels
        self._tenants: set[str] = set()        # tenants that keep their own label
        self.registry = registry if registry is not None else CollectorRegistry()
        self._labels_lock = threading.Lock()
        self._named: set[str] = set()          # adapters that keep their own label
        r = self.registry

        self._requests = Counter("loraplex_requests", "Requests by adapter and outcome "
                                 "(stop, length, abort, error, rejected)", ["adapter", "outcome"], registry=r)
        self._adapter_requests = Counter("loraplex_adapter_requests", "Requests by each adapter they ran with and "
                                         "outcome: a composed request counts once for each member; base-model "
                                         "requests are not counted", ["adapter", "outcome"], registry=r)
        self._rejected = Counter("loraplex_requests_rejected", "Requests refused before running, by HTTP status",
                                 ["adapter", "status"], registry=r)
        self._prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens of finished requests",
                                      ["adapter"], registry=r)
        self._generation_tokens = Counter("loraplex_generation_tokens", "Generated tokens of finished requests",
                                          ["adapter"], registry=r)
        self._tenant_requests = Counter("loraplex_tenant_requests", "Requests by tenant (of --api-keys) and outcome "
                                        "(stop, length, abort, error, rejected)", ["tenant", "outcome"], registry=r)
        self._tenant_prompt_tokens = Counter("loraplex_tenant_prompt_tokens", "Prompt tokens of finished requests "
                                             "by tenant", ["tenant"], registry=r)
        self._tenant_generation_tokens = Counter("loraplex_tenant_generation_tokens", "Generated tokens of finished "
                                                 "requests by tenant", ["tenant"], registry=r)
        self._ttft = Histogram("loraplex_time_to_first_token_seconds", "Time from arrival to the first token",
                               ["adapter"], buckets=TTFT_BUCKETS, registry=r)
        self._tpot = Histogram("loraplex_time_per_output_token_seconds", "Mean time between output tokens "
                               "of a request", ["adapter"], buckets=TPOT_BUCKETS, registry=r)
        self._e2e = Histogram("loraplex_e2e_request_latency_seconds", "Time from arrival to the last token",
                              ["adapter"], buckets=E2E_BUCKETS, registry=r)
        self._step_tokens = Histogram("loraplex_step_tokens", "Tokens (prefill and decode) in one engine step",
                                      buckets=STEP_TOKEN_BUCKETS, registry=r)
        self._step_seqs = Histogram("loraplex_step_sequences", "Sequences in one engine step",
                                    buckets=STEP_SEQ_BUCKETS, registry=r)
        self._running = Gauge("loraplex_num_requests_running", "Requests in the running batch", registry=r)
        self._waiting = Gauge("loraplex_num_requests_waiting", "Requests waiting to run", registry=r)
        self._kv_usage = Gauge("loraplex_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)",
                               registry=r)
        self._tiers = Gauge("loraplex_adapters", "Registered adapters by where they are (gpu, cpu, disk, "
                            "loading, failed)", ["tier"], registry=r)
        self._load = Histogram("loraplex_adapter_load_seconds", "Adapter load latency by stage (register: "
                               "validate and index; disk: read to CPU; slot_wait: host copy waiting for a GPU "
                               "slot; copy_issue: queueing its copies; gpu: copy into a slot)", ["stage"],
                               buckets=LOAD_BUCKETS, registry=r)

        # The gateway's defaults. It has read both KV names over time (gpu_ before vLLM v1, kv_ after), and
        # num_requests_running is in its protocol; exporting all costs nothing.
        self._vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to run", registry=r)
        self._vllm_running = Gauge("vllm:num_requests_running", "Requests in the running batch", registry=r)
        self._vllm_gpu_cache = Gauge("vllm:gpu_cache_usage_perc", "KV cache usage, 0..1 (1 = full)", registry=r)
        self._vllm_kv_cache = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0..1 (1 = full)", registry=r)
        self._lora_info = _LoraInfoCollector()
        r.register(self._lora_info)

        for tier in TIERS:                     # all tiers visible from the first scrape
            self._tiers.labels(tier).set(0)

    # ---- labels ----

    def adapter_label(self, adapter: str | None) -> str:
        """The label for `adapter`: "base" for the base model, the adapter's name for the first
        `max_adapter_labels` distinct names seen, "other" for any later one (bounds the series count)."""
        return self._label(adapter, claim=True)

    def _label(self, adapter: str | None, *, claim: bool) -> str:
        if not adapter:
            return BASE_LABEL
        if adapter == COMPOSED_LABEL:   # any mix of adapters: one label, never a label per mix
            return COMPOSED_LABEL
        with self._labels_lock:
            if adapter in self._named:
                return adapter
            if claim and len(self._named) < self.max_adapter_labels:
                self._named.add(adapter)
                return adapter
        return OTHER_LABEL

    def tenant_label(self, tenant: str | None) -> str:
        """"none" for no tenant, the tenant's name for the first `max_tenant_labels` seen, else "other"."""
        if tenant is None:
            return NO_TENANT_LABEL
        with self._labels_lock:
            if tenant in self._tenants:
                return tenant
            if len(self._tenants) < self.max_tenant_labels:
                self._tenants.add(tenant)
                return tenant
        return OTHER_LABEL

    # ---- request events (HTTP event loop) ----

    def request_finished(self, adapter: str | None, outcome: str, *, prompt_tokens: int, output_tokens: int,
                         ttft_s: float | None, e2e_s: float | None, tpot_s: float | None,
                         tenant: str | None = None, members: tuple[str, ...] | None = None) -> None:
        """One request left the engine. `adapter`: what it named (an adapter, a named composition, COMPOSED_LABEL,
        or None for the base model); `members`: the adapters it ran with (default: `adapter` alone), each counted
        once in `loraplex_adapter_requests_total`. Latencies that were not observed (e.g. no token before an
        abort) are None and are not recorded."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        _check_count("prompt_tokens", prompt_tokens)
        _check_count("output_tokens", output_tokens)
        timings = (("ttft_s", ttft_s, self._ttft), ("tpot_s", tpot_s, self._tpot), ("e2e_s", e2e_s, self._e2e))
        for what, value, _ in timings:
            if value is not None:
                _check_seconds(what, value)
        if members is None:
            members = (adapter,) if adapter and adapter != COMPOSED_LABEL else ()
        label = self.adapter_label(adapter)
        self._requests.labels(label, outcome).inc()
        for member in members:
            self._adapter_requests.labels(self.adapter_label(member), outcome).inc()
        self._prompt_tokens.labels(label).inc(prompt_tokens)
        self._generation_tokens.labels(label).inc(output_tokens)
        for _, value, histogram in timings:
            if value is not None:
                histogram.labels(label).observe(value)
        tenant_label = self.tenant_label(tenant)
        self._tenant_requests.labels(tenant_label, outcome).inc()
        self._tenant_prompt_tokens.labels(tenant_label).inc(prompt_tokens)
        self._tenant_generation_tokens.labels(tenant_label).inc(output_tokens)

    def request_rejected(self, adapter: str | None, status: int, tenant: str | None = None) -> None:
        """A request refused before running (400, 404, 413, 429, ...). A refusal never claims a new adapter
        label: names that only ever appear in refusals (a 404 for a made-up model) count as "other", so
        clients cannot use up the label budget."""
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise ValueError(f"status must be an HTTP status code, got {status!r}")
        label = self._label(adapter, claim=False)
        self._requests.labels(label, "rejected").inc()
        self._rejected.labels(label, str(status)).inc()
        self._tenant_requests.labels(self.tenant_label(tenant), "rejected").inc()

    def adapter_loaded(self, seconds: float, stage: str) -> None:
        """One adapter finished a load stage."""
        if stage not in LOAD_STAGES:
            raise ValueError(f"stage must be one of {LOAD_STAGES}, got {stage!r}")
        _check_seconds("seconds", seconds)
        self._load.labels(stage).observe(seconds)

    # ---- engine events (engine thread) ----

    def observe_step(self, num_tokens: int, num_seqs: int) -> None:
        """One engine step ran `num_seqs` sequences and `num_tokens` tokens."""
        _check_count("num_tokens", num_tokens)
        _check_count("num_seqs", num_seqs)
        self._step_tokens.observe(num_tokens)
        self._step_seqs.observe(num_seqs)

    def set_engine(self, snap: EngineSnapshot) -> None:
        """Refresh every gauge from one snapshot."""
        if not isinstance(snap, EngineSnapshot):
            raise TypeError(f"set_engine needs an EngineSnapshot, got {type(snap).__name__}")
        usage = snap.kv_usage
        self._running.set(snap.num_running)
        self._waiting.set(snap.num_waiting)
        self._kv_usage.set(usage)
        for tier in TIERS:
            self._tiers.labels(tier).set(snap.adapters_by_tier.get(tier, 0))
        self._vllm_waiting.set(snap.num_waiting)
        self._vllm_running.set(snap.num_running)
        self._vllm_gpu_cache.set(usage)
        self._vllm_kv_cache.set(usage)
        self._lora_info.update(_adapter_list(snap.running_adapters), _adapter_list(snap.waiting_adapters),
                               snap.max_gpu_adapters, time.time())

    # ---- exposition ----

    def render(self) -> tuple[bytes, str]:
        """The body and content type of a `/metrics` response."""
        return prometheus_client.generate_latest(self.registry), prometheus_client.CONTENT_TYPE_LATEST

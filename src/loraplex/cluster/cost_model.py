"""How long one engine step takes on an H200, fitted to the engine benchmarks' measured step times.

One step decodes one token for each of `batch` running sequences over `context` KV tokens in all, with
`adapters` distinct adapters among them, and prefills `prefill` new prompt tokens:

    t_ms = a + b·batch + c·context + d·adapters + e·[adapters ≥ 1] + p·prefill

- c (attention reads the K/V of every context token) comes from the paged-attention benchmark: the decode
  rows of llama-2-7b, time against batch × context, times the model's layers. The engine and forward
  benchmarks cannot give it: their context per sequence is always about 400–512 tokens, so context moves
  with batch there.
- a, b, d, e: least squares over the whole-step times of `bench_engine.py` (CUDA graphs) and the decode
  forwards of `bench_model.py`, less c·context. e is the LoRA kernels' fixed cost: one shared adapter costs
  about as much more as a few distinct ones (the "shared" rows), which d alone cannot fit.
- p: least squares through the origin over prompt-carrying steps (the forward benchmark's prefill and the
  engine's mixed prefill+decode steps), less a + e·[adapters ≥ 1]; a compute-bound step costs about the
  same per token whether the token is a prompt's or a decode's, so the mixed steps count all their tokens.
  Mixed steps of the batch-256 runs are left out: their 256 decodes over long contexts are most of the step.

Adapter loads (`AdapterLoadCost`): host→GPU copy and disk read times of `bench_adapter_load.py`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

SOURCES = {"engine": "engine.json", "engine_b32": "engine_b32/process_*.json", "forward": "model_forward.json",
           "attention": "attention.json", "adapter_load": "adapter_load.json"}
ATTENTION_MODEL = "llama2-7b"          # attention.json's name for the shapes the step benchmarks ran
MIN_ATTENTION_BATCH = 32               # smaller batches leave the attention kernel launch-bound
MAX_PREFILL_BATCH = 32                 # larger batches' mixed steps spend much of their time on decodes


@dataclass(frozen=True)
class StepCostModel:
    """Step time in milliseconds (module docstring)."""
    a: float          # ms per step
    b: float          # ms per running sequence
    c: float          # ms per context token
    d: float          # ms per distinct adapter in the batch
    e: float          # ms when any adapter is in the batch
    p: float          # ms per prefilled token

    def step_ms(self, batch: int, context: int, adapters: int, prefill: int = 0) -> float:
        if batch < 0 or context < 0 or adapters < 0 or prefill < 0:
            raise ValueError(f"step_ms needs counts >= 0, got batch={batch} context={context} "
                             f"adapters={adapters} prefill={prefill}")
        return (self.a + self.b * batch + self.c * context + self.d * adapters
                + (self.e if adapters else 0.0) + self.p * prefill)


@dataclass(frozen=True)
class AdapterLoadCost:
    """Seconds until a missing adapter is usable: host copy → GPU slot, or disk → host → GPU."""
    host_to_gpu_s: float
    disk_to_host_s: float

    def load_s(self, in_host_memory: bool) -> float:
        return self.host_to_gpu_s + (0.0 if in_host_memory else self.disk_to_host_s)


@dataclass(frozen=True)
class DecodePoint:
    source: str
    variant: str
    batch: int
    context: int
    adapters: int
    ms: float


@dataclass
class CostFit:
    """A fitted model with the points it came from and its residuals (measured − model, ms)."""
    model: StepCostModel
    loads: AdapterLoadCost
    decode_points: list[DecodePoint]
    decode_residuals: list[float]
    prefill_points: list[dict]
    prefill_residuals: list[float]
    attention_points: int
    sources: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"model": asdict(self.model), "adapter_load": asdict(self.loads), "sources": self.sources,
                "attention_points": self.attention_points,
                "decode": [dict(asdict(p), residual_ms=r) for p, r in zip(self.decode_points, self.decode_residuals)],
                "prefill": [dict(p, residual_ms=r) for p, r in zip(self.prefill_points, self.prefill_residuals)]}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"cost model source missing: {path}") from None


def _adapters(variant: str, batch: int) -> int:
    return {"backbone": 0, "shared": 1, "distinct": batch}[variant]


def _attention_c(results: Path) -> tuple[float, int]:
    """ms per context token for all layers: slope of attention time over batch × context."""
    rows = [r for r in _read(results / SOURCES["attention"])["rows"]
            if r["kind"] == "decode" and r["model"] == ATTENTION_MODEL and r["batch"] >= MIN_ATTENTION_BATCH]
    if len(rows) < 2:
        raise ValueError(f"attention.json has {len(rows)} usable {ATTENTION_MODEL} decode rows, need 2")
    x = np.array([r["batch"] * r["context"] for r in rows], dtype=np.float64)
    y = np.array([r["graph_us"] for r in rows], dtype=np.float64) / 1000
    slope = np.linalg.lstsq(np.stack([np.ones_like(x), x], 1), y, rcond=None)[0][1]
    layers = _read(results / SOURCES["forward"])["layers"]
    return float(slope * layers), len(rows)


def _engine_rows(results: Path) -> list[tuple[str, dict]]:
    """The CUDA-graph rows of engine.json, and of engine_b32/ one row per variant: the median-time row over
    its processes (seven runs of one setting would otherwise outweigh every other point)."""
    rows = [("engine.json", r) for r in _read(results / SOURCES["engine"])["rows"] if r["mode"] == "graphs"]
    by_variant: dict[str, list[dict]] = {}
    for path in sorted((results / "engine_b32").glob("process_*.json")):
        for r in _read(path)["rows"]:
            if r.get("mode", "graphs") == "graphs":
                by_variant.setdefault(r["variant"], []).append(r)
    for variant, group in sorted(by_variant.items()):
        group.sort(key=lambda r: r["full_decode_step_ms"])
        rows.append((f"engine_b32 (median of {len(group)})", group[len(group) // 2]))
    return rows


def _decode_points(results: Path) -> list[DecodePoint]:
    pts = [DecodePoint(src, r["variant"], r["batch"], round(r["batch"] * r["mean_full_context"]),
                       _adapters(r["variant"], r["batch"]), r["full_decode_step_ms"])
           for src, r in _engine_rows(results)]
    for r in _read(results / SOURCES["forward"])["rows"]:
        if r["kind"] == "decode":
            pts.append(DecodePoint("model_forward.json", r["variant"], r["batch"], r["batch"] * r["context"],
                                   r["adapters_read"], r["graph_us"] / 1000))
    return pts


def _prefill_points(results: Path) -> list[dict]:
    pts = []
    for src, r in _engine_rows(results):
        mixed = r["breakdown"]["mixed"]
        if mixed["steps"] and r["batch"] <= MAX_PREFILL_BATCH:
            pts.append({"source": src, "variant": r["variant"], "tokens": mixed["tokens"] / mixed["steps"],
                        "lora": r["variant"] != "backbone", "ms": 1000 * mixed["seconds"] / mixed["steps"]})
    for r in _read(results / SOURCES["forward"])["rows"]:
        if r["kind"] == "prefill":
            pts.append({"source": "model_forward.json", "variant": r["variant"], "tokens": r["batch"] * r["context"],
                        "lora": r["variant"] != "backbone", "ms": r["eager_us"] / 1000})
    return pts


def _adapter_load(results: Path) -> AdapterLoadCost:
    data = _read(results / SOURCES["adapter_load"])
    # the copy as the cache issues it (not the pre-queued best case); a cold read of a PEFT folder
    return AdapterLoadCost(host_to_gpu_s=data["h2d"]["gpu_ms_as_issued"] / 1000,
                           disk_to_host_s=data["single"]["read_cold_ms"] / 1000)


def fit_cost_model(results: str | Path) -> CostFit:
    """Fit the step cost model to the benchmark results under `results` (benchmarks/results)."""
    results = Path(results)
    c, n_attention = _attention_c(results)
    dec = _decode_points(results)
    X = np.array([[1.0, p.batch, p.adapters, float(p.adapters > 0)] for p in dec])
    y = np.array([p.ms - c * p.context for p in dec])
    (a, b, d, e), *_ = np.linalg.lstsq(X, y, rcond=None)
    pre = _prefill_points(results)
    px = np.array([p["tokens"] for p in pre])
    py = np.array([p["ms"] - a - (e if p["lora"] else 0.0) for p in pre])
    p_ms = float(px @ py / (px @ px))
    model = StepCostModel(a=float(a), b=float(b), c=c, d=float(d), e=float(e), p=p_ms)
    dec_res = [p.ms - model.step_ms(p.batch, p.context, p.adapters) for p in dec]
    pre_res = [p["ms"] - (model.a + (model.e if p["lora"] else 0.0) + model.p * p["tokens"]) for p in pre]
    return CostFit(model, _adapter_load(results), dec, dec_res, pre, pre_res, n_attention, dict(SOURCES))

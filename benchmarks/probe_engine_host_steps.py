"""Host time of engine steps at unlimited-batch scale, with the forward stubbed out (runs on the CPU).

The engine's real host work (scheduling, adapter bookkeeping, the graph batch's `update_`, sampling,
postprocessing) over many requests with distinct adapters, while the model forward is replaced by a
stand-in for CUDA graph replays that only lays out the batch (`ForwardBatch.for_graph(...).update_`) and
returns zero logits. A tiny model (1 layer, vocabulary 128) keeps the sampler's CPU work small. Steps
that admit prompts are the ones whose host time the GPU may wait for (with `overlap_admissions` off, or
when a step cannot be queued ahead); decode steps are queued ahead, so theirs hides behind the GPU.
Each kind's p99 and longest step, and Python's garbage collections during the run (count and longest
pause per generation), say whether a few steps stall: `--no-freeze-gc-heap` shows what full collections
cost without `EngineConfig.freeze_gc_heap` (engine/gc_heap.py).

    python benchmarks/probe_engine_host_steps.py --requests 1000 --out benchmarks/results/probe_engine_host_steps.json
    python benchmarks/probe_engine_host_steps.py --no-freeze-gc-heap \
        --out benchmarks/results/probe_engine_host_steps_no_freeze.json
"""
from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from loraplex import SamplingParams
from loraplex.config import EngineConfig
from loraplex.engine import Engine
from loraplex.engine.cuda_graphs import GraphShapes
from loraplex.models.forward_batch import ForwardBatch


def tiny_model(folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def stub_graphs(engine: Engine, max_batch: int, max_prompt_tokens: int):
    runner, batches = engine.runner, {}
    vocab = runner.model.config.vocab_size

    class StubGraphs:   # what StepGraphs.run does on the host, without a forward
        shapes = GraphShapes.make(max_batch, runner.max_model_len, max_prompt_tokens)

        @staticmethod
        def run(chunks, inputs=None, *, key, in_gemm=None):
            if key not in batches:
                batches[key] = ForwardBatch.for_graph(
                    key[0], runner.max_model_len, block_size=runner.kv.block_size, num_blocks=runner.kv.num_blocks,
                    vocab_size=vocab, num_adapter_slots=runner.adapters.pool.num_slots, device="cpu",
                    max_prompt_tokens=key[1])
            batch = batches[key].update_(chunks)
            return torch.zeros(len(batch.logits_seqs), vocab)
    return StubGraphs()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=1200, help="outputs drawn from [50, this]")
    ap.add_argument("--overlap-admissions", action=argparse.BooleanOptionalAction,
                    default=EngineConfig.overlap_admissions, help="EngineConfig.overlap_admissions (default: on)")
    ap.add_argument("--freeze-gc-heap", action=argparse.BooleanOptionalAction, default=EngineConfig.freeze_gc_heap,
                    help="EngineConfig.freeze_gc_heap, and Engine.freeze_heap() once the adapters are registered, "
                         "as the bench does (default: on)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(EngineConfig(model=str(tiny_model(Path(tmp) / "tiny")), dtype="float32", device="cpu",
                                     max_num_seqs=args.max_batch, max_num_batched_tokens=2048,
                                     max_gpu_adapters=args.max_batch, max_cpu_adapters=0, num_kv_blocks=12000,
                                     block_size=16, overlap_admissions=args.overlap_admissions,
                                     freeze_gc_heap=args.freeze_gc_heap))
    engine.runner.graphs = stub_graphs(engine, args.max_batch, 256)
    for i in range(args.requests):
        engine.adapters.register_synthetic(f"a{i}", 16, seed=i)
    engine.freeze_heap()   # (a no-op with --no-freeze-gc-heap)
    rng = random.Random(0)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [5] * rng.randint(8, 40),
                           SamplingParams(max_tokens=rng.randint(50, args.max_tokens), temperature=0,
                                          ignore_eos=True), f"a{i}")
    steps: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
    pauses: list[tuple[int, float]] = []   # Python's garbage collections during the run: (generation, seconds)
    gc_started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - gc_started[0]))

    gc.callbacks.append(on_gc)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        info = engine.last_step
        if info is None:
            time.sleep(0.0005)
            continue
        kind = ("decode" if info.decode else "mixed") + ("" if info.graphed else " eager")
        steps[kind].append((info.seconds, info.num_seqs))
    wall = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    rows = []
    for kind, seen in sorted(steps.items()):
        big = [s for s, n in seen if n >= 128]
        times = sorted(s for s, _ in seen)
        rows.append(dict(kind=kind, steps=len(seen), mean_ms=1e3 * sum(s for s, _ in seen) / len(seen),
                         p99_ms=1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], max_ms=1e3 * times[-1],
                         steps_128_plus=len(big), mean_ms_128_plus=1e3 * sum(big) / len(big) if big else None))
        print(f"{kind:13s} {len(seen):6d} steps, mean {rows[-1]['mean_ms']:.2f} ms; with ≥128 sequences "
              f"{len(big)} steps" + (f", mean {rows[-1]['mean_ms_128_plus']:.2f} ms" if big else "")
              + f"; p99 {rows[-1]['p99_ms']:.1f}, max {rows[-1]['max_ms']:.1f} ms")
    print("garbage collections: " + ", ".join(f"gen{g} {sum(1 for q, _ in pauses if q == g)}×, max "
                                              f"{1e3 * max((t for q, t in pauses if q == g), default=0):.1f} ms"
                                              for g in (0, 1, 2)))
    result = dict(date=datetime.date.today().isoformat(), host=platform.processor() or platform.machine(),
                  torch=torch.__version__, requests=args.requests, max_batch=args.max_batch,
                  overlap_admissions=args.overlap_admissions, freeze_gc_heap=args.freeze_gc_heap,
                  stats=dict(engine.stats),
                  wall_seconds=wall, rows=rows,
                  gc={f"gen{g}": dict(count=sum(1 for q, _ in pauses if q == g),
                                      total_ms=1e3 * sum(t for q, t in pauses if q == g),
                                      max_ms=1e3 * max((t for q, t in pauses if q == g), default=0.0))
                      for g in (0, 1, 2)})
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)

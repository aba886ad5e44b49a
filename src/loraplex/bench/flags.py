"""`loraplex bench`'s flags, apart from the benchmark so that building the CLI imports no torch
(`loraplex --help` stays fast)."""
from __future__ import annotations

import argparse
from pathlib import Path

# (workload.py imports numpy; these are here so that the CLI needs neither it nor torch)
LENGTHS = ("punica", "fixed")
POPULARITIES = ("distinct", "uniform", "skewed", "identical")
HF_SYSTEMS = ("hf-backbone", "hf-peft", "hf-peft-grouped")
SYSTEMS = ("loraplex", "loraplex-backbone") + HF_SYSTEMS


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="dummy:llama-2-7b", help="a model folder or dummy:<preset> (random weights)")
    ap.add_argument("--layers", type=int, default=None, help="dummy models: build this many layers")
    ap.add_argument("--dtype", default=None, help="bfloat16 (default on a GPU), float16 or float32 (default on a CPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--popularity", default="distinct", help=f"comma-separated, of {', '.join(POPULARITIES)}")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--max-batch", default="32", help="comma-separated sizes; 'unlimited' (loraplex only): as "
                                                      "many sequences as the KV memory holds")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lengths", default="punica", choices=LENGTHS)
    ap.add_argument("--max-len", type=int, default=2048, help="punica lengths: longest prompt + output")
    ap.add_argument("--prompt-len", type=int, default=128, help="fixed lengths: prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="fixed lengths: output tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline-requests", type=int, default=None,
                    help="run the hf-* systems on only the first N requests (they are slow), and loraplex on "
                         "those too, for a ratio on the same requests")
    ap.add_argument("--gpu-adapters", type=int, default=None,
                    help="loraplex: GPU adapter slots (default: twice the max batch, at least 8; unlimited: as "
                         "many as the batch)")
    ap.add_argument("--loader-threads", type=int, default=None,
                    help="loraplex: threads reading adapters into host copies (default: the engine's, "
                         "EngineConfig.adapter_loader_threads)")
    ap.add_argument("--cpu-adapters", type=int, default=None,
                    help="loraplex: EngineConfig.max_cpu_adapters, the pinned host copies kept for reloads "
                         "(default: twice the max batch, at least 8; 0: none, each host copy's pinned memory "
                         "goes back to PyTorch's cache once its GPU load is done). It also bounds how far the "
                         "scheduler reads adapters ahead beyond the free GPU slots")
    ap.add_argument("--adapter-host-reserve-gib", type=float, default=None,
                    help="loraplex: EngineConfig.adapter_host_reserve_gib, pinned host memory page-locked at "
                         "start-up for adapter reads (default: the engine's; 0: none)")
    ap.add_argument("--admission-lookahead", type=int, default=None,
                    help="loraplex: EngineConfig.admission_lookahead (default: the engine's; 0 admits whatever "
                         "fits now)")
    ap.add_argument("--overlap-admissions", action=argparse.BooleanOptionalAction, default=None,
                    help="loraplex: EngineConfig.overlap_admissions (steps that admit prompts are queued while "
                         "the step before still runs, as decode steps are; default: the engine's, on)")
    ap.add_argument("--quantization", default=None, choices=("fp8",),
                    help="loraplex: EngineConfig.quantization (fp8: base weights quantized to e4m3 at load)")
    ap.add_argument("--kv-cache-dtype", default=None, choices=("auto", "fp8", "fp8_e4m3"),
                    help="loraplex: EngineConfig.kv_cache_dtype (fp8: the KV cache in e4m3, twice the tokens)")
    ap.add_argument("--preload-adapters", action="store_true",
                    help="loraplex: put each workload's adapters on the GPU before timing (as many as there are "
                         "slots), as the hf-* systems have theirs; default: every adapter starts on disk")
    ap.add_argument("--out-dir", type=Path, default=None, help="write NAME.json, NAME.md and NAME_<popularity>.png")
    ap.add_argument("--name", default="textgen")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")

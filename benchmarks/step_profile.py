"""GPU time per kernel of an engine's full-batch decode steps (torch.profiler over CUDA graph replays) and of its
prompt steps, for `bench_engine.py --profile`: where one variant's step spends the time another's does not.

Kernel durations are summed per kernel name and divided by the profiled steps, so launch gaps and overlap
between streams are not in them: `span_us` (first kernel start to last kernel end, per step) is.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from loraplex import SamplingParams


def profile_decode(engine, prompts: list[list[int]], adapters: list, steps: int = 8) -> dict:
    """Run one request per prompt, and profile `steps` decode steps in which every sequence decodes:
    {"steps", "span_us", "kernels": {name: µs per step}} (the kernels' names as the profiler gives them)."""
    B = engine.config.max_num_seqs
    _add(engine, prompts[:B], adapters[:B], max_tokens=steps + 8)
    while engine.has_unfinished():   # up to the first full decode step
        engine.step()
        info = engine.last_step
        if info is not None and info.decode and info.num_seqs == B:
            break
    return _profile(engine, steps, lambda info: info.decode and info.num_seqs == B)


def profile_prompts(engine, prompts: list[list[int]], adapters: list, steps: int = 4) -> dict:
    """Run one request per prompt (up to max_num_seqs) from an idle engine, and profile its first `steps` steps
    that carry prompt tokens (chunked prefill beside the decodes of sequences whose prompts are done), as
    `profile_decode` reports them."""
    B = engine.config.max_num_seqs
    _add(engine, prompts[:B], adapters[:B], max_tokens=4)
    return _profile(engine, steps, lambda info: not info.decode)


def _add(engine, prompts: list[list[int]], adapters: list, max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"profile{i}", p, params, a)


def _profile(engine, steps: int, counts) -> dict:
    """Profile steps until `steps` of them satisfy `counts(engine.last_step)`, then run the engine dry."""
    from torch.profiler import ProfilerActivity, profile
    _sync()
    done = 0
    with profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU]) as prof:
        while engine.has_unfinished() and done < steps:
            engine.step()
            info = engine.last_step
            done += bool(info is not None and counts(info))
        _sync()
    while engine.has_unfinished():
        engine.step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
              and e.time_range.end > 0 and "Memcpy" not in e.name and "Memset" not in e.name]
    per: dict[str, float] = defaultdict(float)
    for e in events:
        per[e.name] += (e.time_range.end - e.time_range.start) / max(done, 1)
    span = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) if events else 0
    return dict(steps=done, span_us=round(span / max(done, 1), 1),
                kernels={k: round(v, 1) for k, v in sorted(per.items(), key=lambda kv: -kv[1])})


def _sync() -> None:
    if torch.cuda.is_available():   # (the CPU engine of the tests)
        torch.cuda.synchronize()


def short(name: str, width: int = 60) -> str:
    """A kernel name cut to its first `width` characters (cuBLAS names run to hundreds)."""
    return name if len(name) <= width else name[:width - 1] + "…"


def markdown(profiles: dict[str, dict], top: int = 30) -> str:
    """One table: the `top` kernels by their largest µs per step in any variant, a column per variant."""
    names = list(profiles)
    total = defaultdict(float)
    for p in profiles.values():
        for k, v in p["kernels"].items():
            total[k] = max(total[k], v)
    kernels = sorted(total, key=lambda k: -total[k])[:top]
    lines = ["| kernel | " + " | ".join(f"{n} (µs/step)" for n in names) + " |",
             "|---|" + "---:|" * len(names)]
    for k in kernels:
        lines.append(f"| `{short(k)}` | " + " | ".join(f"{profiles[n]['kernels'].get(k, 0):.0f}" for n in names)
                     + " |")
    lines.append("| **all kernels** | " + " | ".join(f"{sum(profiles[n]['kernels'].values()):.0f}" for n in names)
                 + " |")
    lines.append("| **span** | " + " | ".join(f"{profiles[n]['span_us']:.0f}" for n in names) + " |")
    return "\n".join(lines) + "\n"

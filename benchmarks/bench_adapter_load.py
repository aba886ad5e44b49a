"""How fast adapters get from disk to a GPU slot: one adapter, one copy, and a hundred through the cache.

Writes its own PEFT-style adapter folders (no transformers or peft needed): rank `--rank` LoRA on all
seven projections of every layer of a Llama-2-7B-shaped model (≈40M parameters, 160 MB in float32,
as PEFT saves by default; `--source-dtype bfloat16` halves that). Then measures, in one run:

1. disk → CPU, one adapter: `inspect_peft_adapter` (config and safetensors header only) and
   `read_peft_adapter(spec, bfloat16, pin=<cuda>)`, each from a cold page cache and again warm,
   beside a plain read of the same file (and an O_DIRECT read where the filesystem allows it).
2. CPU → GPU, one adapter (CUDA only): `AdapterPool.write(slot, adapter, non_blocking=True)` on a
   side stream; GPU time from CUDA events while the host issues the copies, GPU time of the same
   copies queued up front (the stream held by `torch.cuda._sleep` while the host issues them), and
   the host time spent issuing them; against one pinned→device `copy_` of the same bytes.
3. `--count` adapters through `AdapterCache`: register every folder (header-only validation), then
   prefetch all and drive them like a scheduler (`try_acquire` a FIFO window of requests, hold each
   a few steps, `release`) until every adapter has been resident once, from a cold page cache. The
   same from one packed file made by `convert` (its time too) and `register_packed`.
4. Registering many small adapters (`--many-count`, tiny widths but `--many-layers` layers, so each
   adapter has as many modules as a 7B one): folder by folder, and as one packed file.

"Cold" means: after writing, every file is fsync'ed and dropped from the page cache with
posix_fadvise(DONTNEED), again before each cold phase; the JSON records whether that call worked and
what mincore(2) says of the files' pages just before each cold read (fadvise is only advice; some
sandboxes, gVisor among them, ignore it).

Defaults (100 float32 7B-shaped adapters, 1000 small ones in step 4) need ≈25 GB of disk under
--workdir (default: the temp dir) and took ≈2 min on the one-H200 machine (16 cores, ext4).

    python benchmarks/bench_adapter_load.py --out results.json --md results.md            # GPU run
    python benchmarks/bench_adapter_load.py --model 7b --count 6 --out /tmp/x.json        # CPU, small
    python benchmarks/bench_adapter_load.py --render results.json --md results.md         # table again
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import itertools
import json
import mmap
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch

from loraplex.adapters import AdapterCache, AdapterPool, PackedFile, convert, inspect_peft_adapter, read_peft_adapter
from loraplex.models.config import PROJECTIONS, ModelConfig, module_path

MODELS = {
    # Llama-2-7B's shape (no weights needed: adapters are only checked against it)
    "7b": dict(model_type="llama", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, head_dim=128, vocab_size=32000),
    # small, with grouped-query attention so k/v are narrower than q
    "tiny": dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=32000),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SERVE_DTYPE = torch.bfloat16
GB = 1e9


# ---- small helpers ---------------------------------------------------------------------------------
def now() -> float:
    return time.perf_counter()


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gbs(nbytes: int | float, seconds: float) -> float:
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def _finish_run(out: dict, run: dict, file_bytes: int, adapter_bytes: int, device: str) -> dict:
    """Rates of a completed cache run, peak memory, and the GPU's cached blocks handed back."""
    if run["completed"]:
        out["file_gbs"] = gbs(file_bytes, run["seconds"])
        out["adapter_gbs"] = gbs(adapter_bytes, run["seconds"])
    out["peak_rss_gb"] = peak_rss_gb()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB  # Linux: KiB


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}" if msg else "", flush=True)


def filesystem(path: Path) -> dict:
    """The mount holding `path` (tmpfs would make every "disk" read a memory read), and its read-ahead."""
    best = {"mount": None, "type": None, "source": None, "read_ahead_kb": None}
    try:
        target = str(path.resolve())
        for line in Path("/proc/mounts").read_text().splitlines():
            src, mnt, typ = line.split()[:3]
            if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mount"] or ""):
                best = {"mount": mnt, "type": typ, "source": src, "read_ahead_kb": None}
        if best["source"] and best["source"].startswith("/dev/"):
            dev = Path(best["source"]).resolve().name
            for cand in (dev, dev.rstrip("0123456789"), dev.split("p")[0] if dev.startswith("nvme") else dev):
                ra = Path(f"/sys/block/{cand}/queue/read_ahead_kb")
                if ra.exists():
                    best["read_ahead_kb"] = int(ra.read_text())
                    break
    except (OSError, ValueError):
        pass
    return best


# ---- page cache ------------------------------------------------------------------------------------
_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return _libc


def evict(paths) -> dict:
    """fsync and drop each file's pages from the page cache (advice: the kernel may keep some)."""
    errors, t0 = [], now()
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except (OSError, AttributeError) as e:
            errors.append(f"{p}: {type(e).__name__}: {e}")
    return {"done": not errors, "files": len(paths), "seconds": now() - t0, "errors": errors[:3]}


def resident_fraction(paths) -> float | None:
    """Fraction of the files' pages in the page cache, by mincore(2); None where that cannot be asked."""
    try:
        libc = _lib()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    total = resident = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                pages = (size + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(addr, size, vec) != 0:
                    return None
                resident += int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
                total += pages
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / total if total else None


def raw_read_seconds(path: Path, direct: bool = False) -> float | None:
    """Read the whole file into one reused buffer; with `direct`, O_DIRECT (None if unsupported)."""
    chunk = 16 << 20
    buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    if direct and not getattr(os, "O_DIRECT", 0):
        return None
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        t0 = now()
        while True:
            n = os.readv(fd, [buf])
            if n <= 0:
                break
        return now() - t0
    except OSError:
        return None
    finally:
        os.close(fd)
        buf.close()


# ---- writing adapters --------------------------------------------------------------------------------
def lora_layout(model: ModelConfig, rank: int) -> list[tuple[str, list[int]]]:
    """(PEFT key, shape) of every tensor of a rank-`rank` adapter on all projections of all layers."""
    out = []
    for layer in range(model.num_hidden_layers):
        for proj in PROJECTIONS:
            in_f, out_f = model.projection_shape(proj)
            base = f"base_model.model.{module_path(layer, proj)}"
            out.append((f"{base}.lora_A.weight", [rank, in_f]))
            out.append((f"{base}.lora_B.weight", [out_f, rank]))
    return out


class AdapterWriter:
    """Writes distinct adapters cheaply: each one a different window of one random buffer."""

    STRIDE = 7919

    def __init__(self, model: ModelConfig, rank: int, dtype: torch.dtype, count: int, seed: int = 0):
        self.model, self.rank, self.dtype = model, rank, dtype
        self.layout = lora_layout(model, rank)
        self.numel = sum(int(np.prod(s)) for _, s in self.layout)
        g = torch.Generator().manual_seed(seed)
        self.noise = torch.randn(self.numel + self.STRIDE * count, generator=g) * 0.02

    def write(self, folder: Path, index: int, seconds: dict) -> int:
        from safetensors.torch import save_file
        folder.mkdir(parents=True, exist_ok=True)
        t0 = now()
        tensors, off = {}, index * self.STRIDE
        for key, shape in self.layout:
            n = shape[0] * shape[1]
            tensors[key] = self.noise[off: off + n].view(shape).to(self.dtype, copy=True)
            off += n
        t1 = now()
        cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": 2 * self.rank,
               "lora_dropout": 0.0, "target_modules": list(PROJECTIONS), "bias": "none", "fan_in_fan_out": False,
               "use_rslora": False, "use_dora": False, "modules_to_save": None, "inference_mode": True,
               "base_model_name_or_path": "bench/llama-shape"}
        (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
        path = folder / "adapter_model.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        t2 = now()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t3 = now()
        seconds["generate"] += t1 - t0
        seconds["save"] += t2 - t1
        seconds["fsync"] += t3 - t2
        return path.stat().st_size


def write_adapters(writer: AdapterWriter, root: Path, count: int, prefix: str) -> tuple[list[tuple[str, Path]], dict]:
    seconds = {"generate": 0.0, "save": 0.0, "fsync": 0.0}
    pairs, nbytes = [], 0
    t0 = now()
    for i in range(count):
        folder = root / f"{prefix}{i:05d}"
        nbytes += writer.write(folder, i, seconds)
        pairs.append((f"{prefix}{i:05d}", folder))
    wall = now() - t0
    write_s = seconds["save"] + seconds["fsync"]
    return pairs, {"count": count, "file_bytes": nbytes, "file_mb_each": nbytes / count / 1e6, "wall_s": wall,
                   **{f"{k}_s": v for k, v in seconds.items()}, "write_gbs": gbs(nbytes, write_s)}


def weight_files(pairs) -> list[Path]:
    return [Path(folder) / "adapter_model.safetensors" for _, folder in pairs]


def all_files(pairs) -> list[Path]:
    return [p for _, folder in pairs for p in (Path(folder) / "adapter_config.json",
                                                Path(folder) / "adapter_model.safetensors")]


# ---- 1. disk → CPU -----------------------------------------------------------------------------------
def bench_single(model, pairs, rank, pin, samples) -> dict:
    rows = {k: [] for k in ("raw_cold", "direct", "inspect_cold", "read_cold", "raw_warm", "inspect_warm",
                            "read_warm")}
    resident, evictions, file_bytes, adapter_bytes, host_bytes = [], [], 0, 0, None
    for name, folder in pairs[:samples]:
        path = Path(folder) / "adapter_model.safetensors"
        files = [path, Path(folder) / "adapter_config.json"]
        file_bytes = path.stat().st_size
        evictions.append(evict(files))
        resident.append(resident_fraction([path]))
        rows["raw_cold"].append(raw_read_seconds(path))
        d = raw_read_seconds(path, direct=True)
        if d is not None:
            rows["direct"].append(d)
        evictions.append(evict(files))
        resident.append(resident_fraction([path]))
        t0 = now()
        spec = inspect_peft_adapter(folder, model, name=name, max_rank=rank)
        t1 = now()
        host = read_peft_adapter(spec, SERVE_DTYPE, pin)
        t2 = now()
        rows["inspect_cold"].append(t1 - t0)
        rows["read_cold"].append(t2 - t1)
        adapter_bytes = host.nbytes
        host_bytes = getattr(host, "host_bytes", None)  # memory held (pinned chunks may round up)
        del host
        rows["raw_warm"].append(raw_read_seconds(path))
        t0 = now()
        spec = inspect_peft_adapter(folder, model, name=name, max_rank=rank)
        t1 = now()
        host = read_peft_adapter(spec, SERVE_DTYPE, pin)
        t2 = now()
        rows["inspect_warm"].append(t1 - t0)
        rows["read_warm"].append(t2 - t1)
        del host
    out = {"samples": min(samples, len(pairs)), "file_bytes": file_bytes, "adapter_bytes": adapter_bytes,
           "host_bytes": host_bytes,
           "pinned": pin, "serve_dtype": dtype_name(SERVE_DTYPE), "evicted": all(e["done"] for e in evictions),
           "resident_before_cold": [r for r in resident if r is not None] or None}
    for k, xs in rows.items():
        if xs:
            out[f"{k}_ms"] = med(xs) * 1e3
            out[f"{k}_ms_all"] = [x * 1e3 for x in xs]
            if not k.startswith("inspect"):
                out[f"{k}_gbs"] = gbs(file_bytes, med(xs))
    if not rows["direct"]:
        out["direct_note"] = "O_DIRECT read not supported here"
    return out


# ---- 2. CPU → GPU ------------------------------------------------------------------------------------
def bench_h2d(model, pairs, rank, reps, warmup) -> dict:
    name, folder = pairs[0]
    host = read_peft_adapter(inspect_peft_adapter(folder, model, name=name, max_rank=rank), SERVE_DTYPE, True)
    nbytes = host.nbytes
    pool = AdapterPool(model, 2, rank, SERVE_DTYPE, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the pool's allocation
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def write_once(slot, hold_ms: float = 0.0):
        start, end = ev(), ev()
        with torch.cuda.stream(side):
            if hold_ms:
                torch.cuda._sleep(int(hold_ms * 2.0e6))  # ~2 GHz: hold the stream while the host issues
            start.record(side)
            t0 = now()
            pool.write(slot, host, non_blocking=True)
            issue = now() - t0
            end.record(side)
        side.synchronize()
        return start.elapsed_time(end), issue * 1e3

    for i in range(warmup):
        write_once(i % 2)
    live = [write_once(i % 2) for i in range(reps)]
    issue_ms = med([x[1] for x in live])
    out = {"adapter_bytes": nbytes, "copies_per_write": 2 * len(host.modules) + 2, "reps": reps,
           "gpu_ms_as_issued": med([x[0] for x in live]), "issue_host_ms": issue_ms,
           "issue_host_ms_all": [x[1] for x in live]}
    if hasattr(torch.cuda, "_sleep"):
        hold = max(20.0, 4 * max(x[1] for x in live))
        queued = [write_once(i % 2, hold) for i in range(reps)]
        out["gpu_ms_prequeued"] = med([x[0] for x in queued])
        out["prequeued_hold_ms"] = hold
        out["prequeued_issue_max_ms"] = max(x[1] for x in queued)
    # the floor: one pinned buffer of the same byte count, one copy
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
    flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    times = []
    for i in range(warmup + reps):
        start, end = ev(), ev()
        with torch.cuda.stream(side):
            start.record(side)
            flat.copy_(src, non_blocking=True)
            end.record(side)
        side.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    out["floor_ms"] = med(times)
    out["floor_gbs"] = gbs(nbytes, out["floor_ms"] / 1e3)
    out["gbs_as_issued"] = gbs(nbytes, out["gpu_ms_as_issued"] / 1e3)
    if "gpu_ms_prequeued" in out:
        out["gbs_prequeued"] = gbs(nbytes, out["gpu_ms_prequeued"] / 1e3)
        out["fraction_of_floor_prequeued"] = out["floor_ms"] / out["gpu_ms_prequeued"]
    out["fraction_of_floor_as_issued"] = out["floor_ms"] / out["gpu_ms_as_issued"]
    # check the copy landed: one module, element for element
    (layer, proj), m = next(iter(host.modules.items()))
    r = m.a.shape[0]
    out["verified"] = bool(torch.equal(pool.lora_a[layer][proj][0, :r].cpu(), m.a) and
                           torch.equal(pool.lora_b[layer][proj][0, :, :r].cpu(), m.b))
    pool = flat = src = host = None   # freed before empty_cache (write_once's closure reads pool and host)
    torch.cuda.empty_cache()
    return out


# ---- 3. many adapters through the cache ------------------------------------------------------------
def drive(cache: AdapterCache, names: list[str], *, window: int, hold_steps: int, step_s: float,
          lookahead: int, timeout_s: float, stall_s: float) -> dict:
    """Admit requests (one per adapter, FIFO) like a scheduler until every adapter was resident once.

    Each step: release requests that ran `hold_steps` steps, `try_acquire` the first `window`
    waiting ones (admitting those that are resident), `prefetch` the next `lookahead`, then sleep
    `step_s` (standing in for the model's forward pass). `lookahead < 0`: prefetch all at the start.
    Gives up after `timeout_s`, or when no adapter became resident for `stall_s`.
    """
    t0 = now()
    if lookahead < 0:
        for n in names:
            cache.prefetch(n)
    t_prefetch = now() - t0
    waiting, running, first = deque(names), deque(), {}
    steps, reads_done_s, reads_at_first, last_progress = 0, None, None, 0.0
    while waiting:
        steps += 1
        while running and running[0][1] <= steps:
            cache.release(running.popleft()[0])
        admitted = [n for n in itertools.islice(waiting, window) if cache.try_acquire(n) is not None]
        t = now() - t0
        for n in admitted:
            waiting.remove(n)
            running.append((n, steps + hold_steps))
            first[n] = t
        if admitted:
            last_progress = t
            if reads_at_first is None:
                reads_at_first = cache.counters["disk_reads"]
        if reads_done_s is None and cache.counters["disk_reads"] >= len(names):
            reads_done_s = t
        if lookahead > 0:
            for n in itertools.islice(waiting, window, window + lookahead):
                cache.prefetch(n)
        if t > timeout_s or t - last_progress > stall_s:
            stuck = {n: cache.state(n).value for n in itertools.islice(waiting, 2 * window)}
            return {"completed": False, "stalled_after_s": t, "resident_once": len(first), "steps": steps,
                    "waiting_head_states": stuck, "slot_owners": [cache.slot_owner(s) for s in
                                                                  range(cache.pool.num_slots)],
                    "slot_owner_states": {n: cache.state(n).value for n in
                                          (cache.slot_owner(s) for s in range(cache.pool.num_slots)) if n},
                    "counters": dict(cache.counters)}
        time.sleep(step_s)
    total = max(first.values())
    while running:
        cache.release(running.popleft()[0])
    times = sorted(first.values())
    return {"completed": True, "seconds": total, "prefetch_call_s": t_prefetch, "steps": steps,
            "first_resident_s": times[0], "median_resident_s": med(times), "adapters_per_s": len(names) / total,
            "disk_reads_at_first_resident": reads_at_first, "all_read_s": reads_done_s,
            "counters": dict(cache.counters), "resident_times_s": [round(x, 4) for x in times]}


def make_cache(model, args, device):
    return AdapterCache(model, max_gpu_adapters=args.gpu_slots, max_lora_rank=args.rank,
                        max_cpu_adapters=args.cpu_adapters, dtype=SERVE_DTYPE, device=device,
                        loader_threads=args.loader_threads)


def drive_kwargs(args):
    return dict(window=args.window or args.gpu_slots, hold_steps=args.hold_steps, step_s=args.step_ms / 1e3,
                lookahead=args.lookahead, timeout_s=args.timeout, stall_s=args.stall_timeout)


def bench_folders(model, pairs, args, device, adapter_bytes) -> dict:
    files = all_files(pairs)
    file_bytes = sum(p.stat().st_size for p in weight_files(pairs))
    cache = make_cache(model, args, device)
    try:
        ev = evict(files)
        res_reg = resident_fraction(weight_files(pairs)[:8])
        t0 = now()
        for name, folder in pairs:
            cache.register(name, folder)
        register_s = now() - t0
        ev2 = evict(files)
        res = resident_fraction(weight_files(pairs))
        run = drive(cache, [n for n, _ in pairs], **drive_kwargs(args))
    finally:
        cache.close()
    out = {"count": len(pairs), "file_bytes": file_bytes, "adapter_bytes": adapter_bytes * len(pairs),
           "register_s": register_s, "register_ms_each": register_s / len(pairs) * 1e3,
           "evicted": ev["done"] and ev2["done"], "resident_before_register": res_reg,
           "resident_before_load": res, **run}
    del cache  # the pool's GPU memory goes back before the next run
    return _finish_run(out, run, file_bytes, adapter_bytes * len(pairs), device)


def bench_packed(model, pairs, args, device, adapter_bytes, packed_dir: Path) -> dict:
    evict(all_files(pairs))
    dtype = None if args.packed_dtype == "source" else DTYPES[args.packed_dtype]
    t0 = now()
    path = convert(model, list(pairs), packed_dir, dtype=dtype, progress=False)
    convert_s = now() - t0
    ev = evict([path])
    size = path.stat().st_size
    res_reg = resident_fraction([path])
    one = {}
    packed = PackedFile(path, model)
    index = len(packed.specs) // 2
    for label in ("cold", "warm"):
        t0 = now()
        host = packed.read(index, SERVE_DTYPE, device == "cuda")
        one[f"packed_read_{label}_ms"] = (now() - t0) * 1e3
        del host
        if label == "cold":  # how much of the file that one read pulled into the page cache (read-around)
            one["resident_after_one_cold_read"] = resident_fraction([path])
    del packed
    ev0 = evict([path])
    cache = make_cache(model, args, device)
    try:
        t0 = now()
        names = cache.register_packed(path)
        register_s = now() - t0
        ev2 = evict([path])
        res = resident_fraction([path])
        run = drive(cache, names, **drive_kwargs(args))
    finally:
        cache.close()
    t0 = now()
    PackedFile(path, model)
    reopen_warm_s = now() - t0
    out = {"count": len(names), "packed_dtype": args.packed_dtype if dtype else "source", "file_bytes": size,
           "convert_s": convert_s, "convert_fsync_s": ev["seconds"],
           "convert_source_gbs": gbs(sum(p.stat().st_size for p in weight_files(pairs)), convert_s),
           "register_packed_ms": register_s * 1e3, "packedfile_open_warm_ms": reopen_warm_s * 1e3,
           "adapter_bytes": adapter_bytes * len(names), "evicted": ev["done"] and ev0["done"] and ev2["done"],
           "one_adapter_bytes": adapter_bytes, **one,
           "resident_before_register": res_reg, "resident_before_load": res, **run}
    del cache  # the pool's GPU memory goes back before the next run
    return _finish_run(out, run, size, adapter_bytes * len(names), device)


# ---- 4. registering many small adapters -----------------------------------------------------------------
def bench_many(args, root: Path, device) -> dict:
    model = ModelConfig(model_type="llama", hidden_size=64, intermediate_size=128,
                        num_hidden_layers=args.many_layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=32000)
    rank = args.many_rank
    writer = AdapterWriter(model, rank, torch.bfloat16, args.many_count, seed=1)
    pairs, write = write_adapters(writer, root / "many", args.many_count, "m")
    files = all_files(pairs)
    cache = AdapterCache(model, max_gpu_adapters=args.gpu_slots, max_lora_rank=rank, max_cpu_adapters=0,
                         dtype=SERVE_DTYPE, device=device, loader_threads=1)
    try:
        ev = evict(files)
        t0 = now()
        for name, folder in pairs:
            cache.register(name, folder)
        register_s = now() - t0
    finally:
        cache.close()
    evict(files)
    t0 = now()
    path = convert(model, pairs, root / "many_packed", dtype=torch.bfloat16, progress=False)
    convert_s = now() - t0
    ev2 = evict([path])
    cache = AdapterCache(model, max_gpu_adapters=args.gpu_slots, max_lora_rank=rank, max_cpu_adapters=0,
                         dtype=SERVE_DTYPE, device=device, loader_threads=1)
    try:
        t0 = now()
        names = cache.register_packed(path)
        packed_s = now() - t0
    finally:
        cache.close()
    t0 = now()
    PackedFile(path, model)
    reopen_warm_s = now() - t0
    return {"count": len(names), "model": {"hidden_size": 64, "intermediate_size": 128,
                                           "num_hidden_layers": args.many_layers, "num_key_value_heads": 2},
            "rank": rank, "modules_per_adapter": args.many_layers * len(PROJECTIONS),
            "write_s": write["wall_s"], "file_bytes": write["file_bytes"], "evicted": ev["done"] and ev2["done"],
            "register_folders_s": register_s, "register_folders_ms_each": register_s / len(pairs) * 1e3,
            "convert_s": convert_s, "packed_file_bytes": path.stat().st_size,
            "register_packed_s": packed_s, "register_packed_ms_each": packed_s / len(names) * 1e3,
            "packedfile_open_warm_s": reopen_warm_s}


# ---- report ------------------------------------------------------------------------------------------
def _f(x, nd=1):
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def summary_rows(res: dict) -> list[tuple[str, str, str]]:
    rows = []
    add = lambda sec, what, val: rows.append((sec, what, val))  # noqa: E731
    s = res["settings"]
    w = res.get("write")
    if w:
        add("write", f"{w['count']} adapters × {w['file_mb_each']:.1f} MB ({s['source_dtype']})",
            f"{w['wall_s']:.1f} s wall; save+fsync {w['write_gbs']:.2f} GB/s")
    one = res.get("single")
    if one:
        sec = "1 disk→CPU"
        fb = one["file_bytes"] / 1e6
        add(sec, f"file {fb:.1f} MB → {one['adapter_bytes'] / 1e6:.1f} MB {one['serve_dtype']}"
                 f"{' pinned' if one['pinned'] else ''}; median of {one['samples']}", "")
        for key, label in (("inspect_cold", "inspect (headers), cold"), ("inspect_warm", "inspect (headers), warm")):
            add(sec, label, f"{one[key + '_ms']:.2f} ms")
        for key, label in (("read_cold", "read_peft_adapter, cold"), ("read_warm", "read_peft_adapter, warm"),
                           ("raw_cold", "plain file read, cold"), ("raw_warm", "plain file read, warm"),
                           ("direct", "O_DIRECT file read")):
            if key + "_ms" in one:
                add(sec, label, f"{one[key + '_ms']:.1f} ms = {one[key + '_gbs']:.2f} GB/s")
        add(sec, "page cache evicted / resident before cold",
            f"{one['evicted']} / {_f(max(one['resident_before_cold']) if one['resident_before_cold'] else None, 3)}")
    h = res.get("h2d")
    if h and "skipped" not in h:
        sec = "2 CPU→GPU"
        add(sec, f"pool.write, {h['adapter_bytes'] / 1e6:.1f} MB in {h['copies_per_write']} copies, side stream",
            "")
        add(sec, "GPU time as issued", f"{h['gpu_ms_as_issued']:.2f} ms = {h['gbs_as_issued']:.1f} GB/s")
        if "gpu_ms_prequeued" in h:
            add(sec, "GPU time, copies queued first", f"{h['gpu_ms_prequeued']:.2f} ms = {h['gbs_prequeued']:.1f} GB/s"
                                                      f" ({h['fraction_of_floor_prequeued']:.0%} of floor)")
        add(sec, "host time issuing", f"{h['issue_host_ms']:.2f} ms")
        add(sec, "floor: one pinned→device copy_", f"{h['floor_ms']:.2f} ms = {h['floor_gbs']:.1f} GB/s")
        add(sec, "copy verified", str(h["verified"]))
    elif h:
        add("2 CPU→GPU", "skipped", h["skipped"])
    for key, sec in (("load_folders", "3 cache, folders"), ("load_packed", "3 cache, packed")):
        r = res.get(key)
        if not r:
            continue
        if key == "load_folders":
            add(sec, f"register {r['count']} folders", f"{r['register_s'] * 1e3:.0f} ms "
                                                       f"({r['register_ms_each']:.2f} ms each)")
        else:
            add(sec, f"convert {r['count']} folders → {r['packed_dtype']} ({r['file_bytes'] / GB:.2f} GB)",
                f"{r['convert_s']:.1f} s (+{r['convert_fsync_s']:.1f} s fsync)")
            add(sec, "register_packed", f"{r['register_packed_ms']:.1f} ms")
            if "packed_read_cold_ms" in r:
                add(sec, "one adapter, PackedFile.read cold / warm",
                    f"{r['packed_read_cold_ms']:.1f} / {r['packed_read_warm_ms']:.1f} ms "
                    f"= {gbs(r['one_adapter_bytes'], r['packed_read_cold_ms'] / 1e3):.2f} / "
                    f"{gbs(r['one_adapter_bytes'], r['packed_read_warm_ms'] / 1e3):.2f} GB/s")
                add(sec, "file in page cache after that one cold read",
                    f"{_f(r.get('resident_after_one_cold_read'), 3)} (one adapter is {1 / r['count']:.3f})")
        if r["completed"]:
            add(sec, f"all {r['count']} resident once (cold)",
                f"{r['seconds']:.2f} s = {r['adapters_per_s']:.1f} adapters/s, {r['file_gbs']:.2f} GB/s file, "
                f"{r['adapter_gbs']:.2f} GB/s {res['settings']['serve_dtype']}")
            c = r["counters"]
            add(sec, "disk reads / GPU loads / GPU evictions",
                f"{c['disk_reads']} / {c['gpu_loads']} / {c['gpu_evictions']}")
            add(sec, "first resident / median / all reads done",
                f"{r['first_resident_s']:.2f} / {r['median_resident_s']:.2f} / {_f(r.get('all_read_s'), 2)} s")
            add(sec, "peak RSS of the process so far", f"{r['peak_rss_gb']:.1f} GB")
        else:
            add(sec, "DID NOT COMPLETE", f"stalled after {r['stalled_after_s']:.1f} s, "
                                         f"{r['resident_once']}/{r['count']} resident once")
        add(sec, "evicted / resident before load", f"{r['evicted']} / {_f(r['resident_before_load'], 3)}")
    m = res.get("many")
    if m:
        sec = "4 many small"
        add(sec, f"{m['count']} adapters, {m['modules_per_adapter']} modules each", "")
        add(sec, "register folders", f"{m['register_folders_s']:.2f} s ({m['register_folders_ms_each']:.2f} ms each)")
        add(sec, "convert", f"{m['convert_s']:.1f} s")
        add(sec, "register_packed",
            f"{m['register_packed_s'] * 1e3:.0f} ms ({m['register_packed_ms_each']:.3f} ms each)")
    return rows


def render_text(res: dict) -> str:
    rows = summary_rows(res)
    wa = max(len(r[0]) for r in rows)
    wb = max(len(r[1]) for r in rows)
    m = res["meta"]
    lines = [f"{m['device']} | torch {m['torch']} | {m['cpu_count']} CPUs | {m['date_utc']} | "
             f"total {m.get('total_s', float('nan')):.0f} s"]
    lines += [f"{a:<{wa}}  {b:<{wb}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def render_markdown(res: dict) -> str:
    m, s = res["meta"], res["settings"]
    out = [f"# Adapter loading: {m['device']}", "",
           f"torch {m['torch']}, {m['cpu_count']} CPUs, {m['date_utc']}, git {m.get('git', 'n/a')}; "
           f"model {s['model']}, rank {s['rank']}, sources {s['source_dtype']}, served {s['serve_dtype']}, "
           f"{s['count']} adapters, cache: {s['gpu_slots']} GPU slots, {s['cpu_adapters']} CPU copies, "
           f"{s['loader_threads']} loader threads, window {s['window'] or s['gpu_slots']}, "
           f"lookahead {s['lookahead']} (-1: prefetch all); total {m.get('total_s', float('nan')):.0f} s.", "",
           "| step | measurement | value |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in summary_rows(res)]
    return "\n".join(out) + "\n"


def meta() -> dict:
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        cpu = platform.processor()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        device = f"{cpu or platform.machine()} cpu"
    git = None
    try:
        here = Path(__file__).resolve().parent
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "../src"], cwd=here, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        git = (head + ("+dirty src" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        pass
    import safetensors
    return {"device": device, "cuda": torch.cuda.is_available(), "torch": torch.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "git": git}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="7b")
    p.add_argument("--count", type=int, default=100, help="adapters for step 3")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--source-dtype", choices=sorted(DTYPES), default="float32", help="dtype of the written files")
    p.add_argument("--packed-dtype", choices=["bfloat16", "float16", "float32", "source"], default="bfloat16",
                   help="convert's dtype for the packed file (source: keep the sources')")
    p.add_argument("--gpu-slots", type=int, default=8, help="AdapterCache max_gpu_adapters")
    p.add_argument("--cpu-adapters", type=int, default=0, help="AdapterCache max_cpu_adapters")
    p.add_argument("--loader-threads", type=int, default=4)
    p.add_argument("--window", type=int, default=0, help="requests tried per scheduler step (0: --gpu-slots)")
    p.add_argument("--hold-steps", type=int, default=2, help="scheduler steps a request keeps its adapter")
    p.add_argument("--step-ms", type=float, default=1.0, help="sleep per scheduler step (the forward pass)")
    p.add_argument("--lookahead", type=int, default=-1,
                   help="prefetch this many requests past the window each step; -1: prefetch all at the start")
    p.add_argument("--timeout", type=float, default=240.0, help="give up a step-3 run after this many seconds")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="give up a step-3 run when no adapter became resident for this many seconds")
    p.add_argument("--single-samples", type=int, default=3, help="adapters timed one by one in step 1")
    p.add_argument("--h2d-reps", type=int, default=20)
    p.add_argument("--many-count", type=int, default=1000,
                   help="step 4 (0 skips it; 2000 adds ≈75 s on the H200 machine)")
    p.add_argument("--many-layers", type=int, default=32)
    p.add_argument("--many-rank", type=int, default=2)
    p.add_argument("--no-packed", action="store_true", help="skip the packed-file half of step 3")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--workdir", type=Path, default=None,
                   help="where to write the files (a fresh folder inside it, removed at the end)")
    p.add_argument("--keep", action="store_true", help="keep the written files")
    p.add_argument("--out", type=Path, default=None, help="JSON results")
    p.add_argument("--md", type=Path, default=None, help="markdown table")
    p.add_argument("--render", type=Path, default=None, help="only print (and --md) the tables of a results JSON")
    args = p.parse_args(argv)

    if args.render:
        res = json.loads(args.render.read_text())
        log(render_text(res))
        if args.md:
            args.md.write_text(render_markdown(res))
        return res

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cuda = device == "cuda"
    model = ModelConfig(**MODELS[args.model])
    source_dtype = DTYPES[args.source_dtype]
    params = model.lora_parameter_count(args.rank)
    src_bytes = params * torch.tensor([], dtype=source_dtype).element_size()
    packed_bytes = params * 2 * args.count if not args.no_packed else 0
    many_bytes = 0
    if args.many_count:
        many_model_params = args.many_layers * args.many_rank * (4 * 64 + 2 * 32 + 2 * 64 + 3 * (64 + 128))
        many_bytes = many_model_params * 2 * args.many_count * 2 + args.many_count * 8192 * 2
    need = src_bytes * args.count + packed_bytes + many_bytes
    base = args.workdir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(base).free
    if need * 1.05 + (1 << 30) > free:
        sys.exit(f"not enough disk in {base}: need ≈{need / GB:.1f} GB, {free / GB:.1f} GB free "
                 f"(try --source-dtype bfloat16, a smaller --count or --no-packed)")
    work = Path(tempfile.mkdtemp(prefix="loraplex-bench-", dir=base))

    def on_term(signum, frame):  # e.g. `timeout`: still write what was measured and remove the files
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_term)

    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings.update(model=args.model, model_config=MODELS[args.model], serve_dtype=dtype_name(SERVE_DTYPE),
                    device=device, lora_params=params, workdir_used=str(work), disk_free_gb=free / GB,
                    disk_needed_gb=need / GB, filesystem=filesystem(work))
    res: dict = {"meta": meta(), "settings": settings}
    log(f"{res['meta']['device']}: {args.count} adapters of {params / 1e6:.1f}M params, "
        f"{src_bytes / 1e6:.0f} MB each ({args.source_dtype}); files in {work} (≈{need / GB:.1f} GB)")
    t_start = now()
    phases = res["meta"]["phase_s"] = {}

    def phase(name, fn, *a):
        t0 = now()
        try:
            return fn(*a)
        finally:
            phases[name] = now() - t0

    try:
        writer = AdapterWriter(model, args.rank, source_dtype, args.count)
        pairs, res["write"] = phase("write", write_adapters, writer, work / "adapters", args.count, "a")
        del writer
        w = res["write"]
        log(f"wrote {args.count} in {w['wall_s']:.1f} s (save+fsync {w['write_gbs']:.2f} GB/s)")
        res["page_cache"] = {"eviction": evict(all_files(pairs)),
                             "resident_after_evict": resident_fraction(weight_files(pairs)[:8])}

        res["single"] = phase("single", bench_single, model, pairs, args.rank, cuda, args.single_samples)
        one = res["single"]
        log(f"1 disk→CPU: read cold {one['read_cold_ms']:.1f} ms, warm {one['read_warm_ms']:.1f} ms")
        adapter_bytes = one["adapter_bytes"]

        if cuda:
            res["h2d"] = phase("h2d", bench_h2d, model, pairs, args.rank, args.h2d_reps, 3)
            h = res["h2d"]
            log(f"2 CPU→GPU: {h['gpu_ms_as_issued']:.2f} ms as issued, floor {h['floor_ms']:.2f} ms")
        else:
            res["h2d"] = {"skipped": "no CUDA device"}

        res["load_folders"] = phase("load_folders", bench_folders, model, pairs, args, device, adapter_bytes)
        log(f"3 folders: {res['load_folders'].get('seconds', float('nan')):.2f} s for {args.count}")
        if not args.no_packed:
            res["load_packed"] = phase("load_packed", bench_packed, model, pairs, args, device, adapter_bytes,
                                       work / "packed")
            log(f"3 packed: {res['load_packed'].get('seconds', float('nan')):.2f} s, "
                f"convert {res['load_packed']['convert_s']:.1f} s")
            (work / "packed" / "adapters.safetensors").unlink(missing_ok=True)  # disk back for step 4
        if args.many_count:
            res["many"] = phase("many", bench_many, args, work, device)
            log(f"4 many: {args.many_count} packed registered in {res['many']['register_packed_s'] * 1e3:.0f} ms")
    except BaseException as e:
        res["meta"]["aborted"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        res["meta"]["total_s"] = now() - t_start
        res["meta"]["peak_rss_gb"] = peak_rss_gb()
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1, default=str))
        try:
            text, md = render_text(res), render_markdown(res)
        except Exception as e:  # a partial run: the JSON has what there is
            text = md = f"(no table: {type(e).__name__}: {e})"
        log("")
        log(text)
        if args.md:
            args.md.parent.mkdir(parents=True, exist_ok=True)
            args.md.write_text(md)
    return res


if __name__ == "__main__":
    main()

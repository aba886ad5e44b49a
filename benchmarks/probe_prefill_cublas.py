"""The prompt rows' LoRA through cuBLAS, one GEMM per prompt segment, against the Triton kernels (GPU probe).

The prompt tiles' Triton expand runs at 1.6–2.2× the time of a plain read-modify-write of the same output
(results/probe_prefill_expand.json), bound by each program's serial step (load y, tensor-core product, layout
conversion, store), whatever its launch settings. cuBLAS's GEMMs pipeline their epilogue's loads of C; an
expand is a GEMM of K = rank with beta = 1: `y[seg, cols_i] += scaling · v[seg] @ B_i[slot]ᵀ`. Designs, each
a whole projection (its GEMM included) of Llama-2-7B (q/k/v, o, gate/up, down) per case, a CUDA-graph replay
over rotating x:

- `default`: the GEMM, then sgmv's shrink and expand over every row (the engine's prompt steps today);
- `stored`: sgmv's shrink and expand storing the product, then the GEMM adding to it (cuBLAS's beta = 1;
  ops/stored_lora.py, LORAPLEX_LORA_PREFILL=store);
- `cublas_expand`: the GEMM and sgmv's shrink over every row; the prompt segments' products added by `addmm_`
  per segment and slice from the shrink's partials summed and rounded to x's dtype (PEFT rounds its `lora_A`
  output too); the decode rows by sgmv's expand over those rows alone;
- `cublas_store`: as `cublas_expand`, but the products stored (`addmm` with beta = 0 into the output's rows and
  columns, the decode rows by sgmv's expand storing), then the GEMM adding to them.

Each design's output is checked against a float64 loop of the documented semantics (`rel_err`), and the
number of launches a forward would issue from the host is recorded (the engine's prompt steps are eager).
Measured on an H200 (2026-12-03, results/probe_prefill_cublas.json): both cuBLAS designs slower than the default,
1,214–1,326 against 1,145–1,170 µs a layer at 1,820–1,920 rows.

    python benchmarks/probe_prefill_cublas.py --out benchmarks/results/probe_prefill_cublas.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_lora_ops import copy_bandwidth_gbs, graphed, time_us  # noqa: E402

from loraplex.ops.lora import sgmv  # noqa: E402
from loraplex.ops.lora.batch import LoraBatch  # noqa: E402

RANK = 16
ROTATIONS = 3
PROJECTIONS = {"qkv": (4096, (4096, 4096, 4096)), "o": (4096, (4096,)), "gate_up": (4096, (11008, 11008)),
               "down": (11008, (4096,))}
CASES = {"mixed": [300] * 6 + [1] * 20, "prompts": [320] * 6, "mixed3": [391] * 3 + [1] * 29}
DESIGNS = ("default", "stored", "cublas_expand", "cublas_store")
DEVICE = "cuda"   # tests run the designs on the CPU through Triton's interpreter


def tensors(K: int, Ns: tuple, rows: int, slots: int, gen: torch.Generator) -> dict:
    bf = dict(dtype=torch.bfloat16, device=DEVICE)
    scalings = [torch.rand(slots, generator=gen, device=DEVICE) + 0.5 for _ in Ns]
    return dict(
        xs=[torch.randn(rows, K, generator=gen, device=DEVICE).to(torch.bfloat16) for _ in range(ROTATIONS)],
        ys=[torch.empty(rows, sum(Ns), dtype=torch.bfloat16, device=DEVICE) for _ in range(ROTATIONS)],   # the floor's
        a=[(torch.randn(slots, RANK, K, generator=gen, device=DEVICE) * K ** -0.5).to(**bf) for _ in Ns],
        b=[(torch.randn(slots, n, RANK, generator=gen, device=DEVICE) * RANK ** -0.5).to(**bf) for n in Ns],
        ranks=[torch.full((slots,), RANK, dtype=torch.int32, device=DEVICE) for _ in Ns],
        w=(torch.randn(sum(Ns), K, generator=gen, device=DEVICE) * K ** -0.5).to(**bf),
        scalings=scalings, scal_host=[s.tolist() for s in scalings])


def oracle(t: dict, seg_lens: list, x: torch.Tensor) -> torch.Tensor:
    """float64: x @ Wᵀ + scaling · (x @ A[slot]ᵀ) @ B[slot]ᵀ per segment and slice (segment j uses slot j)."""
    out = x.double() @ t["w"].double().T
    start, ns = 0, [b.shape[1] for b in t["b"]]
    for j, n in enumerate(seg_lens):
        xs = x[start:start + n].double()
        col = 0
        for i, N in enumerate(ns):
            v = xs @ t["a"][i][j].double().T
            out[start:start + n, col:col + N] += t["scal_host"][i][j] * (v @ t["b"][i][j].double().T)
            col += N
        start += n
    return out


class Design:
    """One design's forward of one projection: `run(i)` returns `x_i @ Wᵀ` plus every row's LoRA product."""

    def __init__(self, name: str, t: dict, seg_lens: list):
        self.name, self.t = name, t
        self.prompts = [(j, n) for j, n in enumerate(seg_lens) if n > 1]
        self.P = sum(n for _, n in self.prompts)
        decodes = [j for j, n in enumerate(seg_lens) if n == 1]
        if any(n > 1 for n in seg_lens[self.P:]):
            raise ValueError("the probe's cases put prompts before decode rows")
        self.batch = LoraBatch.from_lengths(seg_lens, list(range(len(seg_lens))), DEVICE)   # every row
        self.cfg = sgmv.config_for(self.batch.block_m)
        # the decode rows alone (the cuBLAS designs' sgmv expand)
        self.small = LoraBatch.from_lengths([1] * len(decodes), decodes, DEVICE) if decodes else None
        self.small_cfg = sgmv.config_for(self.small.block_m) if decodes else None
        self.rows = slice(self.P, self.P + len(decodes))
        self.parts = [sgmv.new_partials(x, t["a"], self.batch, self.cfg) for x in t["xs"]]
        self.ns = [b.shape[1] for b in t["b"]]
        per_prompts = len(self.prompts) * len(self.ns)   # one cuBLAS call a segment and slice
        self.launches = {"default": 3, "stored": 3, "cublas_expand": 4 + per_prompts + bool(decodes),
                         "cublas_store": 4 + per_prompts + bool(decodes)}[name]

    def run(self, i: int) -> torch.Tensor:
        t, x, part = self.t, self.t["xs"][i], self.parts[i]
        w = t["w"]
        if self.name == "default":
            y = torch.nn.functional.linear(x, w)
            sgmv.shrink_into(part, x, t["a"], t["ranks"], self.batch, self.cfg)
            sgmv.expand_from(y, part, t["b"], t["ranks"], t["scalings"], self.batch, 0, self.cfg)
            return y
        if self.name == "stored":   # ops/stored_lora.py: the product stored, the GEMM adds to it
            y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
            sgmv.add_lora(y, x, t["a"], t["b"], self.batch, t["ranks"], t["scalings"], 0, accumulate=False)
            return y.addmm_(x, w.t())
        store = self.name == "cublas_store"
        y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device) if store else \
            torch.nn.functional.linear(x, w)
        sgmv.shrink_into(part, x, t["a"], t["ranks"], self.batch, self.cfg)
        v = part[:, :, :self.P].sum(0).to(x.dtype)   # [slices, P, R]: the prompt rows' shrink, rounded
        start = 0
        for j, n in self.prompts:
            col = 0
            for sl, N in enumerate(self.ns):
                out = y[start:start + n, col:col + N]
                if store:
                    torch.addmm(out, v[sl, start:start + n], t["b"][sl][j].T, beta=0, alpha=t["scal_host"][sl][j],
                                out=out)
                else:
                    out.addmm_(v[sl, start:start + n], t["b"][sl][j].T, alpha=t["scal_host"][sl][j])
                col += N
            start += n
        if self.small is not None:   # the decode rows' product from the same partials
            sgmv.expand_from(y[self.rows], part[:, :, self.rows], t["b"], t["ranks"], t["scalings"], self.small, 0,
                             self.small_cfg, accumulate=not store)
        return y.addmm_(x, w.t()) if store else y


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    copy_gbs = copy_bandwidth_gbs()
    rows_out, totals = [], {}
    for case in args.cases.split(","):
        seg_lens = CASES[case]
        rows = sum(seg_lens)
        for proj, (K, Ns) in PROJECTIONS.items():
            t = tensors(K, Ns, rows, len(seg_lens), gen)
            floor_us = time_us([graphed(lambda y=y: y.add_(1)) for y in t["ys"]])
            want = oracle(t, seg_lens, t["xs"][0])
            base = t["xs"][0].double() @ t["w"].double().T
            for name in DESIGNS:
                d = Design(name, t, seg_lens)
                got = d.run(0).double()
                err = ((got - want).norm() / (want - base).norm()).item()
                if not err < 2e-2:
                    raise SystemExit(f"{case} {proj} {name}: off the float64 loop by {err:.2e} (of the product)")
                us = time_us([graphed(lambda i=i: d.run(i)) for i in range(ROTATIONS)])
                totals.setdefault(case, {}).setdefault(name, 0.0)
                totals[case][name] += us
                row = dict(case=case, projection=proj, design=name, rows=rows, us=us, rmw_floor_us=floor_us,
                           vs_floor=us / floor_us, host_launches=d.launches, rel_err_of_product=err)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  torch=torch.__version__, rank=RANK, copy_gbs=copy_gbs, total_us=totals, rows=rows_out)
    for case, by in totals.items():
        print(f"{case}: µs a layer (GEMM + shrink + expand, four projections):",
              ", ".join(f"{k} {v:.0f}" for k, v in by.items()))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()

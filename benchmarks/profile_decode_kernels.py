"""Per-kernel GPU time of eager Llama-2-7B decode forwards (batch 32, context 512, distinct adapters) in each
LoRA mode (ops/overlap.py; "backbone": no adapters), from the PyTorch profiler: where a mode's time goes,
kernel by kernel.

    python benchmarks/profile_decode_kernels.py --modes full,fused --out profile.txt
    python benchmarks/profile_decode_kernels.py --modes backbone,fused --batch 160 --context 640
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_model import decode_setup, kernel_profile  # noqa: E402


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="full,fused")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    B = args.batch
    model, kv, pool, batch = decode_setup(B, args.context)
    text = []
    for mode in args.modes.split(","):
        # "backbone": the same forward without adapters, for what LoRA adds kernel by kernel
        os.environ["LORAPLEX_LORA_OVERLAP"] = "off" if mode == "backbone" else mode
        adapters = None if mode == "backbone" else pool
        for _ in range(3):
            model(batch, kv, adapters)
        text.append(kernel_profile(lambda: model(batch, kv, adapters), f"{mode}, batch {B} distinct, eager"))
    out = "\n\n".join(text)
    print(out)
    if args.out:
        args.out.write_text(out)
    return out


if __name__ == "__main__":
    main()

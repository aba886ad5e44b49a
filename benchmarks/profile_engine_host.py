"""Host-time profile (cProfile) of eager engine forwards with distinct adapters: where the CPU goes."""
import cProfile
import io
import pstats
import sys

import torch

sys.path.insert(0, "benchmarks")
from loraplex import SamplingParams  # noqa: E402
from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine import Engine  # noqa: E402

B = 32
engine = Engine(EngineConfig(model="dummy:llama-2-7b", dtype="bfloat16", max_num_seqs=B, max_gpu_adapters=B,
                             max_cpu_adapters=0, enforce_eager=True, max_model_len=1024,
                             gpu_memory_utilization=0.5))
for i in range(B):
    engine.adapters.register_synthetic(f"a{i}", 16, seed=i)
for i in range(B):
    engine.adapters.wait_resident(f"a{i}", timeout=300)
for i in range(B):
    engine.add_request(f"r{i}", [5] * 200, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True), f"a{i}")
for _ in range(20):
    engine.step()
torch.cuda.synchronize()
prof = cProfile.Profile()
prof.enable()
for _ in range(10):
    engine.step()
torch.cuda.synchronize()
prof.disable()
out = io.StringIO()
pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
print(out.getvalue())

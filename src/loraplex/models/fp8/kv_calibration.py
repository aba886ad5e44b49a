"""KV-cache scales computed at start-up (`EngineConfig.calculate_kv_scales`), for an FP8 KV cache whose checkpoint
brings none, or whose keys or values reach past e4m3's 448 at scale 1.0 (large k_proj biases, for one).

One forward of the base model (no adapters) over `CALIBRATION_SEQS` sequences of random token ids writes its keys
and values into a cache of the model's dtype; each layer's scale is then

    k_scale[l] = HEADROOM · max |k| / 448      (v_scale[l] likewise; 1.0 for a layer whose keys are all 0)

so that keys up to HEADROOM times the largest seen still fit e4m3 (vLLM leaves 2.2× for keys, 4.5× for values).
Random tokens stand in for real text: a layer's largest keys come mostly from its weights, biases and rotary
angles, which they exercise, but a prompt may still reach past them: the headroom is for that.
"""
from __future__ import annotations

import torch

from ...ops.gemm.fp8 import E4M3_MAX
from ..forward_batch import ForwardBatch, SequenceChunk
from ..kv_cache import KVCache
from .kv_scales import KvScales

HEADROOM = 2.0
CALIBRATION_SEQS = 4
CALIBRATION_TOKENS = 256   # a sequence's (positions 0-255: the rotary angles of a prompt's start)


def calibration_prompts(vocab_size: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """CALIBRATION_SEQS sequences of min(CALIBRATION_TOKENS, max_len) random token ids."""
    n = max(1, min(CALIBRATION_TOKENS, max_len))
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for _ in range(CALIBRATION_SEQS)]


def calibrate_kv_scales(model, prompts: list[list[int]], *, block_size: int = 16) -> KvScales:
    """fp32 `[layers]` k and v scales of `model` (a LlamaForCausalLM) for an e4m3 cache, by the module docstring's
    rule, from one forward of the base model over `prompts`."""
    c = model.config
    blocks_each = [-(-len(p) // block_size) for p in prompts]
    kv = KVCache(c, sum(blocks_each), block_size, dtype=model.dtype, device=model.device)
    kv.data.zero_()   # slots past a sequence's last token count as 0, not as stale memory
    chunks, start = [], 0
    for prompt, n in zip(prompts, blocks_each):
        chunks.append(SequenceChunk(prompt, 0, list(range(start, start + n))))
        start += n
    batch = ForwardBatch.build(chunks, block_size=block_size, num_blocks=kv.num_blocks, vocab_size=c.vocab_size,
                               device=model.device)
    with torch.inference_mode():
        model(batch, kv)
        amax = kv.data.abs().flatten(2).amax(dim=2).float().cpu()   # [layers, 2]: keys, values
    scales = torch.where(amax > 0, HEADROOM * amax / E4M3_MAX, torch.ones_like(amax))
    return KvScales(k=scales[:, 0].contiguous(), v=scales[:, 1].contiguous())

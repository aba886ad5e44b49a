"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over one flat mixed batch, LoRA on every projection.

One forward runs every token of every sequence together (`ForwardBatch`): each dense layer is
one GEMM over all rows plus one batched LoRA launch (`ops.add_lora`, each sequence its own
adapter slot); q/k/v and gate/up are fused GEMMs whose LoRA is one multi-slice launch.
Attention is per sequence over the paged KV cache. Norms, RoPE and SiLU-and-mul are fused
ops that round where transformers rounds, so outputs match transformers + PEFT.

Weights keep Hugging Face's `[out, in]` orientation; fused weights are row blocks of their
parts (`qkv_proj = [q; k; v]`, `gate_up_proj = [gate; up]`), filled by the loader.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.active_area import ActiveArea
from ..adapters.pool import AdapterPool
from ..ops import add_lora, resolve_backend
from ..ops.lora import api
from ..ops.lora import overlap
from ..ops.fused import silu_lora_tiles
from ..ops.gemm import skinny_lora
from ..ops.attention.paged import paged_attention, store_kv
from ..ops.attention.attention_shrink import decode_attention_shrink
from ..ops.fused.api import apply_rope, rms_norm, silu_and_mul
from ..ops.lora.delta import LoraDelta
from ..ops.lora.lora_in_gemm import expand_in_gemm
from ..ops.lora.product import LoraProduct
from ..ops.fused.rms_shrink import rms_norm_shrink
from ..ops.fused.silu_shrink import silu_and_mul_shrink
from ..ops.gemm.skinny import linear as base_linear   # a Triton GEMM for few rows on GPUs, else F.linear
from ..ops.lora.stored_lora import applies as stored_lora_applies, linear_with_lora_stored
from .config import ModelConfig
from .forward_batch import ForwardBatch
from .kv_cache import KVCache

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
GROUP_OF = {QKV: "qkv", ("o_proj",): "o", GATE_UP: "gate_up", ("down_proj",): "down"}  # ActiveArea's groups
# The "in-gemm" path leaves q/k/v's product for RoPE to expand as it loads q/k/v (one launch less per layer:
# the projections alone took ~0.38 ms less per Llama-2-7B forward at 32 rows than with the expand kernel,
# benchmarks/results/probe_lora_in_gemm.md); o, gate/up and down expand in place after their GEMM.
IN_GEMM_QKV_TO_ROPE = True
# Where the projections leave their products to the next op (the "delta"/"product" paths, forwards of up to
# overlap.MAX_ROWS rows), down's shrink can run inside the SiLU-and-mul before it (ops/silu_shrink.py; not where
# gate/up's product is a LoraProduct): only its expand then goes beside the down GEMM, or none where down is a
# "fused" projection (its product left to the next RMSNorm, with FUSED_BOUNDARIES too). Off: measured slower
# on an H200 (2026-12-01, Llama-2-7B decode forwards at batch 32 in CUDA graphs, results/decode_graph_trace_
# silu2.json): 246.1 µs a layer against 243.4 with the shrink beside the GEMM, as the SiLU that reads A took
# 7.2 µs (2.7 without) and the down block as long as before.
DOWN_SHRINK_IN_SILU = False
LEFT_FOR_NEXT_OP = ("delta", "delta-side", "product", "product-side")
# Fused layer boundaries: where an RMSNorm expands the product of the projection before it (o or down in
# overlap.fused_projections) over programs of fused_lora_kernels.RMS_SPLIT columns, it also computes the next
# projection's shrink (ops/rms_shrink.py), whose GEMM then starts with no shrink launch before it (q/k/v's
# product left to RoPE, or an expand beside the GEMM). Off: slower on an H200 (2026-12-01, Llama-2-7B decode
# forwards at batch 32 in CUDA graphs, results/decode_graph_trace_od.json): 7,888-8,439 µs against 7,844 for
# today's path, as the norm computing the shrink took about as long as the norm and the shrink it replaced.
FUSED_BOUNDARIES = False
# At decode (every sequence one row) on those paths, the attention kernel also computes o's shrink over its heads'
# columns (ops/attention_shrink.py), so the o GEMM starts with no shrink launch before it and only the expand
# beside it (not where o is a "fused" projection, nor where the attention splits the context: decode graphs are
# captured for the longest context, so on an H200 it splits under 264 sequences × kv heads, e.g. at every batch
# ≤ 32 of Llama-3-8B's 8 kv heads and ≤ 8 of Llama-2-7B's 32). Off: slower on an H200 (2026-12-02, Llama-2-7B
# decode forwards at batch 32 in CUDA graphs, results/decode_graph_trace_oattn.json): 1.028× today's path's time
# (1.040× with A's tile loaded after the key walk), as the attention took ~2.7 µs a layer longer and the expand
# summing 32 kv heads' partials ran ~10 µs a layer more alone, not beside the GEMM (against the same session's
# trace of today's path).
O_SHRINK_IN_ATTENTION = False


def _weight(out_features: int, in_features: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)


def _bias(out_features: int, present: bool) -> nn.Parameter | None:
    return nn.Parameter(torch.empty(out_features), requires_grad=False) if present else None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c, self.layer = config, layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_width, self.kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.eps, self.scale = c.rms_norm_eps, c.head_dim ** -0.5
        self.sliding_window = c.sliding_window(layer)
        self.input_layernorm = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.qkv_proj = _weight(self.q_width + 2 * self.kv_width, c.hidden_size)
        self.qkv_bias = _bias(self.q_width + 2 * self.kv_width, c.qkv_bias)
        self.o_proj = _weight(c.hidden_size, self.q_width)
        self.o_bias = _bias(c.hidden_size, c.o_bias)
        self.post_attention_layernorm = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.gate_up_proj = _weight(2 * c.intermediate_size, c.hidden_size)
        self.gate_up_bias = _bias(2 * c.intermediate_size, c.mlp_bias)
        self.down_proj = _weight(c.hidden_size, c.intermediate_size)
        self.down_bias = _bias(c.hidden_size, c.mlp_bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, delta: LoraDelta | LoraProduct | None,
                batch: ForwardBatch, kv: KVCache, pool: AdapterPool | None, inv_freq: torch.Tensor,
                backend: str | None, lora_path: str = "checked", area: ActiveArea | None = None,
                area_count: int = 0) -> tuple[torch.Tensor, torch.Tensor, LoraDelta | LoraProduct | None]:
        """One layer: `(hidden, residual, delta)` in and out; `delta` is the LoRA product that the
        "delta" paths (a LoraDelta) and "product" paths (a LoraProduct) leave for the next op to
        add to `hidden` (None otherwise). `lora_path` as LlamaForCausalLM.forward picks it; "in-gemm"
        reads the A rows of `area`'s first `area_count` active adapters."""
        T, L = hidden.shape[0], self.layer
        lora = pool is not None and batch.has_adapters
        # the projections whose product the next op expands ("fused", overlap.fused_projections)
        fused_projs = overlap.fused_projections(T, decode=batch.max_query_len == 1) \
            if lora_path.startswith("product") else frozenset()

        def project(x: torch.Tensor, weight, bias,
                    projs: tuple[str, ...]) -> tuple[torch.Tensor, LoraDelta | LoraProduct | None]:
            if not lora:
                return base_linear(x, weight, bias), None
            a, b, ranks, scalings = pool.stacks(L, projs)   # fused projections: one multi-slice launch
            if lora_path == "in-gemm":
                # one GEMM gives the base output and every active adapter's shrink; each row's expand reads
                # its own adapter's columns and adds into the base ones (ops/lora_in_gemm.py)
                w_ext, b_ext = area.weight(L, GROUP_OF[projs], area_count)
                y_ext = F.linear(x, w_ext, b_ext)
                n = weight.shape[0]
                if projs == QKV and IN_GEMM_QKV_TO_ROPE:
                    S, R = len(projs), b[0].shape[2]   # the shrink columns, seen as a LoraProduct's part
                    part = torch.as_strided(y_ext, (1, S, T, R), (0, R, y_ext.stride(0), 1),
                                            y_ext.storage_offset() + n)
                    return y_ext[:, :n], LoraProduct(part, tuple(b), tuple(ranks), tuple(scalings),
                                                     batch.lora.row_slot, area.slot_active, area_count)
                expand_in_gemm(y_ext, n, b, ranks, scalings, batch.lora, area.slot_active,
                               backend=resolve_backend(backend, x.device))
                return y_ext[:, :n], None
            if lora_path == "gemm-lora" and skinny_lora.applies(x, weight, [t.shape[1] for t in b]):
                return skinny_lora.skinny_lora_linear(x, weight, bias, a, b, batch.lora, ranks, scalings), None
            if projs[0] in fused_projs:
                return overlap.linear_with_lora_product(x, weight, bias, a, b, batch.lora, ranks, scalings,
                                                        side=lora_path == "product-side")
            if lora_path in ("delta", "delta-side", "product", "product-side"):
                return overlap.linear_with_lora_delta(x, weight, bias, a, b, batch.lora, ranks, scalings,
                                                      side=lora_path.endswith("-side"))
            if lora_path == "shrink-side":
                return overlap.linear_with_lora(x, weight, bias, a, b, batch.lora, ranks, scalings), None
            if projs == GATE_UP and lora_path in ("direct", "stored") and silu_lora_tiles.enabled():
                # only the shrink: SiLU-and-mul expands the product over the same work tiles (ops/silu_lora_tiles.py)
                return overlap.linear_with_lora_product(x, weight, bias, a, b, batch.lora, ranks, scalings,
                                                        side=False, tiles=True)
            if lora_path == "stored" and bias is None:   # the expand first, the GEMM adds to it (ops/stored_lora.py)
                return linear_with_lora_stored(x, weight, a, b, batch.lora, ranks, scalings), None
            y = base_linear(x, weight, bias)
            if lora_path in ("direct", "stored", "gemm-lora"):  # the Triton kernels without the per-call checks
                return api.sgmv.add_lora(y, x, a, b, batch.lora, ranks, scalings, 0), None
            return add_lora(y, x, a, b, batch.lora, ranks, scalings, backend=backend), None

        def norm_then_project(h, residual, delta, norm_weight, weight, bias, projs: tuple[str, ...]):
            """(residual, projection output, its product) after the RMSNorm of `h` (+ residual, + delta)."""
            split = _rms_split() if lora and FUSED_BOUNDARIES and lora_path in LEFT_FOR_NEXT_OP else 0
            if split and isinstance(delta, LoraProduct) and delta.slot_active is None:
                a, b, ranks, scalings = pool.stacks(L, projs)
                x, residual, part = rms_norm_shrink(h, norm_weight, self.eps, residual=residual, delta=delta,
                                                    lora_a=a, ranks=ranks, row_slot=batch.lora.row_slot,
                                                    block=split, backend=backend)
                if projs[0] in fused_projs:
                    return residual, base_linear(x, weight, bias), LoraProduct(part, tuple(b), tuple(ranks),
                                                                            tuple(scalings), batch.lora.row_slot)
                y, d = overlap.linear_with_lora_expand(x, weight, bias, part, b, batch.lora, ranks, scalings,
                                                       side=lora_path.endswith("-side"))
                return residual, y, d
            x, residual = rms_norm(h, norm_weight, self.eps, residual=residual, delta=delta, backend=backend)
            return (residual, *project(x, weight, bias, projs))

        residual, qkv, delta = norm_then_project(hidden, residual, delta, self.input_layernorm, self.qkv_proj,
                                                 self.qkv_bias, QKV)
        q = qkv[:, :self.q_width].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_width:self.q_width + self.kv_width].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_width + self.kv_width:].view(T, self.num_kv_heads, self.head_dim)
        apply_rope(q, k, batch.positions, inv_freq, v=None if delta is None else v, delta=delta, backend=backend)
        store_kv(k, v, kv.k[L], kv.v[L], batch.slot_mapping, backend=backend)
        attn_args = (q, kv.k[L], kv.v[L], batch.block_tables, batch.seq_lens, batch.query_start)
        part = None
        if lora and O_SHRINK_IN_ATTENTION and lora_path in LEFT_FOR_NEXT_OP and batch.max_query_len == 1 and \
                "o_proj" not in fused_projs:
            a, b, ranks, scalings = pool.stacks(L, ("o_proj",))
            attn, part = decode_attention_shrink(*attn_args, max_seq_len=batch.max_seq_len, scale=self.scale,
                                                 sliding_window=self.sliding_window, lora_a=a[0], ranks=ranks[0],
                                                 row_slot=batch.lora.row_slot, backend=backend)
        else:
            attn = paged_attention(*attn_args, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
                                   scale=self.scale, sliding_window=self.sliding_window, backend=backend)
        if part is not None:   # only the expand is left
            out, delta = overlap.linear_with_lora_expand(attn.view(T, self.q_width), self.o_proj, self.o_bias, part,
                                                         b, batch.lora, ranks, scalings,
                                                         side=lora_path.endswith("-side"))
        else:
            out, delta = project(attn.view(T, self.q_width), self.o_proj, self.o_bias, ("o_proj",))
        residual, gate_up, delta = norm_then_project(out, residual, delta, self.post_attention_layernorm,
                                                     self.gate_up_proj, self.gate_up_bias, GATE_UP)
        if lora and DOWN_SHRINK_IN_SILU and lora_path in LEFT_FOR_NEXT_OP and not isinstance(delta, LoraProduct):
            a, b, ranks, scalings = pool.stacks(L, ("down_proj",))
            act, part = silu_and_mul_shrink(gate_up, a[0], ranks[0], batch.lora.row_slot, delta=delta,
                                            backend=backend)
            if "down_proj" in fused_projs:
                return base_linear(act, self.down_proj, self.down_bias), residual, LoraProduct(
                    part, tuple(b), tuple(ranks), tuple(scalings), batch.lora.row_slot)
            out, delta = overlap.linear_with_lora_expand(act, self.down_proj, self.down_bias, part, b, batch.lora,
                                                         ranks, scalings, side=lora_path.endswith("-side"))
            return out, residual, delta
        out, delta = project(silu_and_mul(gate_up, delta=delta, backend=backend), self.down_proj, self.down_bias,
                             ("down_proj",))
        return out, residual, delta


def _rms_split() -> int:
    """fused_lora_kernels.RMS_SPLIT (imported here: the "product" paths run on Triton only)."""
    from ..ops.fused import lora_kernels as fused_lora_kernels
    return fused_lora_kernels.RMS_SPLIT


def _select_rows(delta: LoraDelta | LoraProduct | None, rows: torch.Tensor) -> LoraDelta | LoraProduct | None:
    return None if delta is None else delta.select(rows)


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 (GQA, `llama3`/`linear` RoPE scaling, tied or untied embeddings); base of the others."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        # Tied embeddings are not registered twice: module moves (to_empty, to) would untie them.
        self.lm_head_weight = None if config.tie_word_embeddings else \
            nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.register_buffer("inv_freq", config.rope.inv_freq(config.head_dim), persistent=False)
        self.backend: str | None = None  # ops backend: None picks Triton on CUDA, the reference on the CPU
        # The A rows of the active adapters below each projection's weight (adapters/active_area.py), set by
        # whoever builds it (before any graph capture); forwards run inside `lora_in_gemm(count)` use it.
        self.active_area: ActiveArea | None = None
        self._in_gemm_count: int | None = None

    @contextlib.contextmanager
    def lora_in_gemm(self, count: int | None = None):
        """Forwards inside take the "in-gemm" LoRA path: each projection's GEMM also computes the shrink of
        `active_area`'s first `count` active adapters (default: those active now, at least 1), and each row's
        expand reads its adapter's columns (ops/lora_in_gemm.py). The caller keeps the area holding the batch's
        adapters (`ActiveArea.update`) at indices below `count`: eager forwards check that; a CUDA graph
        captured inside replays with `count` fixed, so replay it only after an update to at most `count`."""
        area = self.active_area
        if area is None:
            raise ValueError("lora_in_gemm needs an active_area attached to the model")
        count = max(area.count, 1) if count is None else count
        if not isinstance(count, int) or not 1 <= count <= area.capacity:
            raise ValueError(f"count must be an int in [1, {area.capacity}] (the area's capacity), got {count!r}")
        previous, self._in_gemm_count = self._in_gemm_count, count
        try:
            yield
        finally:
            self._in_gemm_count = previous

    def _apply(self, fn, recurse: bool = True):
        # Module moves and casts (to, half, to_empty) would cast or blank the rotary frequencies;
        # they stay float32, recomputed wherever the weights go.
        super()._apply(fn, recurse)
        if self.inv_freq.device.type != "meta":
            self.inv_freq = self.config.rope.inv_freq(self.config.head_dim).to(self.inv_freq.device)
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache, pool: AdapterPool | None = None) -> torch.Tensor:
        """float32 logits `[len(batch.logits_rows), vocab]`, one row per sequence that asked for them.

        Writes the batch's new keys and values into `kv_cache`. Sequences with adapter slot -1
        (or every sequence, without a `pool`) run the base model.
        """
        self._check(batch, kv_cache, pool)
        hidden = F.embedding(batch.input_ids, self.embed_tokens)
        residual = delta = None
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            path = self._lora_path(batch, pool)
            for layer in self.layers:
                hidden, residual, delta = layer(hidden, residual, delta, batch, kv_cache, pool, self.inv_freq,
                                                self.backend, path, self.active_area, self._in_gemm_count or 0)
        # Only the rows that get logits go through the final norm and the lm_head.
        rows = batch.logits_rows
        hidden, _ = rms_norm(hidden.index_select(0, rows), self.norm, self.config.rms_norm_eps,
                             residual=residual.index_select(0, rows),
                             delta=_select_rows(delta, rows), backend=self.backend)
        return base_linear(hidden, self.lm_head).float()

    def _lora_path(self, batch: ForwardBatch, pool: AdapterPool | None) -> str:
        """How the projections add LoRA: "in-gemm" (inside `lora_in_gemm`: the shrink inside each
        projection's GEMM, any backend), "checked" (`ops.add_lora`: the reference backend on the CPU),
        or on the Triton path, where every argument is the model's own (shapes by construction, the
        batch and pool checked in `_check`) and the 128 calls of a step skip their checks (they cost
        more host time than the kernels take in eager steps): "direct" (`sgmv.add_lora` after each
        GEMM), "stored" (as "direct", but the biasless projections store the product first and the GEMM adds
        to it: eager forwards where every row has an adapter, ops/stored_lora.py), "delta" (each product
        left for the next op to add, in forwards of up to
        `overlap.MAX_ROWS` rows), "delta-side" (the same, the LoRA kernels on a side stream beside the
        GEMMs, while a CUDA graph is captured), "product" / "product-side" (as "delta", but only the
        shrink runs and the next op expands it: LORAPLEX_LORA_OVERLAP=fused, for the projections in
        `overlap.fused_projections`, the shrink where `overlap.shrink_order` puts it, by default right after the
        GEMM on the same stream; the others as "delta") or "shrink-side" (only the
        shrink beside, in captured forwards of up to `overlap.SHRINK_MAX_ROWS` rows), or "gemm-lora" (each
        projection's shrink and expand inside its GEMM's launch, ops/skinny_lora.py: LORAPLEX_SKINNY_LORA=on,
        forwards of up to 32 rows; projections it does not fit as "direct").
        See ops/overlap.py; eager steps keep one stream, where forks and joins cost host time."""
        if pool is not None and self._in_gemm_count is not None:
            area = self.active_area
            if area.pool is not pool:
                raise ValueError("lora_in_gemm: the model's active_area was built for another adapter pool")
            capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
            if not capturing and not area.holds(batch.lora.group_slots, below=self._in_gemm_count):
                raise ValueError(f"lora_in_gemm({self._in_gemm_count}): the active area does not hold the batch's "
                                 f"adapters (slots {list(batch.lora.group_slots)}) at indices below "
                                 f"{self._in_gemm_count}: ActiveArea.update them first")
            return "in-gemm"
        if pool is None or resolve_backend(self.backend, self.device) != "triton":
            return "checked"
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        path = overlap.lora_path(batch.input_ids.shape[0], capturing, self.dtype, self.device)
        return "stored" if path == "direct" and not capturing and stored_lora_applies(batch.lora) else path

    @property
    def lm_head(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head_weight is None else self.lm_head_weight

    def _check(self, batch: ForwardBatch, kv: KVCache, pool: AdapterPool | None) -> None:
        if (batch.block_size, batch.num_blocks) != (kv.block_size, kv.num_blocks):
            raise ValueError(f"the batch was built for {batch.num_blocks} KV blocks of {batch.block_size} tokens; "
                             f"the cache has {kv.num_blocks} of {kv.block_size}")
        if batch.vocab_size != self.config.vocab_size:
            raise ValueError(f"the batch was checked against a vocabulary of {batch.vocab_size}; "
                             f"the model's is {self.config.vocab_size}")
        shape = lambda c: (c.num_hidden_layers, c.num_key_value_heads, c.head_dim)  # noqa: E731
        if shape(kv.model) != shape(self.config):
            raise ValueError(f"the KV cache holds (layers, kv heads, head_dim) = {shape(kv.model)}; "
                             f"the model has {shape(self.config)}")
        if kv.dtype != self.dtype or kv.device != self.device:
            raise ValueError(f"the KV cache is {kv.dtype} on {kv.device}; the model is {self.dtype} on {self.device}")
        if batch.input_ids.device != self.device:
            raise ValueError(f"the batch is on {batch.input_ids.device}; the model is on {self.device}")
        if pool is not None:
            if pool.dtype != self.dtype or pool.ranks.device != self.device:
                raise ValueError(f"the adapter pool is {pool.dtype} on {pool.ranks.device}; "
                                 f"the model is {self.dtype} on {self.device}")
            if pool.model.num_hidden_layers != self.config.num_hidden_layers:
                raise ValueError("the adapter pool was made for a different model")
            if batch.lora.max_slot >= pool.num_slots:
                raise ValueError(f"the batch uses adapter slot {batch.lora.max_slot}; the pool has {pool.num_slots}")


class MistralForCausalLM(LlamaForCausalLM):
    """Llama's layout with a sliding attention window (from the config) on every layer."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's layout with biases on q/k/v and, when the config enables it, sliding-window layers."""

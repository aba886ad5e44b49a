"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over one flat mixed batch, LoRA on every projection.

One forward runs every token of every sequence together (`ForwardBatch`). Each projection kind is a
`LoraLinear` (one GEMM over all rows plus the LoRA of each row's adapter); q/k/v and gate/up are fused
GEMMs whose LoRA is one multi-slice launch. How LoRA runs is decided once per forward (`LoraPlan`):
where a projection leaves its LoRA pending, the op after it adds it (RoPE for q/k/v, SiLU-and-mul for
gate/up, the next RMSNorm for o and down). Attention is per sequence over the paged KV cache. Norms,
RoPE and SiLU-and-mul round where transformers rounds, so outputs match transformers + PEFT.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ..adapters.pool import AdapterPool
from ..ops import paged_attention, store_kv
from ..ops.attention import KV_FP8
from ..ops.fused.api import apply_rope, rms_norm, silu_and_mul
from ..ops.gemm.skinny import linear as base_linear   # a Triton GEMM for few rows on GPUs, else F.linear
from ..ops.lora import overlap
from .config import ModelConfig
from .forward_batch import ForwardBatch
from .fp8.kv_scales import KvScales
from .kv_cache import KVCache
from .lora_linear import DOWN, GATE_UP, O, QKV, LoraLinear
from .lora_plan import LoraPlan, Pending, side_stream_rows


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c, self.layer = config, layer
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_width, self.kv_width = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.eps, self.scale = c.rms_norm_eps, c.head_dim ** -0.5
        self.sliding_window = c.sliding_window(layer)
        self.input_layernorm = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.qkv_proj = LoraLinear(layer, QKV, c.hidden_size, self.q_width + 2 * self.kv_width, c.qkv_bias)
        self.o_proj = LoraLinear(layer, O, self.q_width, c.hidden_size, c.o_bias)
        self.post_attention_layernorm = nn.Parameter(torch.empty(c.hidden_size), requires_grad=False)
        self.gate_up_proj = LoraLinear(layer, GATE_UP, c.hidden_size, 2 * c.intermediate_size, c.mlp_bias)
        self.down_proj = LoraLinear(layer, DOWN, c.intermediate_size, c.hidden_size, c.mlp_bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, pending: Pending, batch: ForwardBatch,
                kv: KVCache, plan: LoraPlan, inv_freq: torch.Tensor,
                backend: str | None) -> tuple[torch.Tensor, torch.Tensor, Pending]:
        """One layer: `(hidden, residual, pending)` in and out; `pending` is the LoRA the previous projection (the
        last layer's down) left for this layer's first RMSNorm to add."""
        T, L = hidden.shape[0], self.layer
        # FP8 weights under W8A8: each RMSNorm also writes its output quantized a row, for the GEMM after it
        x_e4m3 = self.qkv_proj.e4m3_input(hidden)
        x, residual = rms_norm(hidden, self.input_layernorm, self.eps, residual=residual, delta=pending,
                               e4m3=x_e4m3, backend=backend)        # + down's LoRA of the layer before
        qkv, pending = self.qkv_proj(x, plan, x_e4m3)
        q = qkv[:, :self.q_width].view(T, self.num_heads, self.head_dim)
        k = qkv[:, self.q_width:self.q_width + self.kv_width].view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_width + self.kv_width:].view(T, self.num_kv_heads, self.head_dim)
        apply_rope(q, k, batch.positions, inv_freq, v=None if pending is None else v, delta=pending,
                   backend=backend)                                 # + q/k/v's LoRA
        k_scale, v_scale = kv.scales(L)                              # (None unless the cache is FP8)
        store_kv(k, v, kv.k[L], kv.v[L], batch.slot_mapping, k_scale=k_scale, v_scale=v_scale, backend=backend)
        attn = paged_attention(q, kv.k[L], kv.v[L], batch.block_tables, batch.seq_lens, batch.query_start,
                               max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, scale=self.scale,
                               sliding_window=self.sliding_window, k_scale=k_scale, v_scale=v_scale, backend=backend)
        out, pending = self.o_proj(attn.view(T, self.q_width), plan)
        x_e4m3 = self.gate_up_proj.e4m3_input(out)
        x, residual = rms_norm(out, self.post_attention_layernorm, self.eps, residual=residual, delta=pending,
                               e4m3=x_e4m3, backend=backend)        # + o's LoRA
        gate_up, pending = self.gate_up_proj(x, plan, x_e4m3)
        act = silu_and_mul(gate_up, delta=pending, backend=backend)  # + gate/up's LoRA
        out, pending = self.down_proj(act, plan)
        return out, residual, pending


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
        # The checkpoint's KV-cache scales (compressed-tensors kv_cache_scheme), set by the loader; an FP8 KV cache
        # takes them (engine/model_runner.py), a cache in the model's dtype has no use for them.
        self.kv_scales: KvScales | None = None

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
        residual, pending = None, None
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            plan = self.lora_plan(batch, pool)
            for layer in self.layers:
                hidden, residual, pending = layer(hidden, residual, pending, batch, kv_cache, plan, self.inv_freq,
                                                  self.backend)
        # Only the rows that get logits go through the final norm and the lm_head.
        rows = batch.logits_rows
        hidden, _ = rms_norm(hidden.index_select(0, rows), self.norm, self.config.rms_norm_eps,
                             residual=residual.index_select(0, rows),
                             delta=None if pending is None else pending.select(rows), backend=self.backend)
        return base_linear(hidden, self.lm_head).float()

    def lora_plan(self, batch: ForwardBatch, pool: AdapterPool | None) -> LoraPlan:
        """How this forward's projections add their LoRA (models/lora_plan.py)."""
        return LoraPlan.make(batch.num_tokens, batch.max_query_len == 1, batch.lora, pool, batch.has_adapters,
                             self.backend, self.device)

    def graph_stream_priority(self, rows: int, lora: bool) -> int:
        """The priority of the stream a CUDA graph of a `rows`-row forward is captured on: high where its LoRA
        kernels take the side stream (so the GEMMs go first), the default elsewhere, where there is nothing to
        order and high-priority kernels would only wait longer for each other."""
        return overlap.CAPTURE_PRIORITY if lora and side_stream_rows(rows) else 0

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
        if kv.dtype not in (self.dtype, KV_FP8) or kv.device != self.device:
            raise ValueError(f"the KV cache is {kv.dtype} on {kv.device}; the model is {self.dtype} on {self.device} "
                             f"(a cache holds the model's dtype or float8_e4m3fn)")
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

"""benchmarks/trace_decode_graph.py's timeline on the CPU: from kernel records (name, start, duration), each kind's
busy time, its time alone (nothing else running), the overlaps by kinds, and the idle gaps, per forward."""
import os

import pytest

from benchmark_modules import load_benchmark


@pytest.fixture()
def probe(monkeypatch):
    return load_benchmark(monkeypatch, "trace_decode_graph")


def test_kinds_of_kernels(probe):
    assert probe.kind_of("nvjet_sm90_tst_192x32_64x7_4x1_v_bz_TNT") == "gemm"
    assert probe.kind_of("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert probe.kind_of("_sgmv_shrink_kernel") == "shrink" and probe.kind_of("_sgmv_expand_kernel") == "expand"
    assert probe.kind_of("_rope_lora_kernel") == "rope" and probe.kind_of("_decode_kernel") == "attention"
    assert probe.kind_of("void at::native::vectorized_elementwise_kernel<4, FillFunctor>") == "fill"
    assert probe.kind_of("something_else") == "other"


def test_timeline_splits_time_into_alone_beside_and_idle(probe):
    # two forwards of: a GEMM [0, 10) with a shrink beside it [2, 5), then RoPE [12, 14) after a 2 µs gap
    one = [dict(name="nvjet_gemm", ts=0.0, dur=10.0), dict(name="_sgmv_shrink_kernel", ts=2.0, dur=3.0),
           dict(name="_rope_kernel", ts=12.0, dur=2.0)]
    events = one + [dict(e, ts=e["ts"] + 20.0) for e in one]   # the second forward starts at 20: 6 µs idle between
    got = probe.timeline(events, reps=2)
    assert got["span_us"] == 17.0                                 # 34 µs over two forwards
    assert got["idle_us"] == 5.0                                  # gaps 10-12, 14-20 and 30-32: 10 µs
    assert got["busy_us"] == {"gemm": 10.0, "shrink": 3.0, "rope": 2.0}
    assert got["alone_us"] == {"gemm": 7.0, "rope": 2.0}
    assert got["beside_us"] == {"gemm+shrink": 3.0}
    # the gaps by the kinds either side: 10-12 and 30-32 after the GEMM, before RoPE; 14-20 after RoPE (the
    # shrink, which ended first, is not the kernel a gap follows)
    assert got["idle_by_edge_us"] == {"rope→gemm": 3.0, "gemm→rope": 2.0}
    assert sum(got["idle_by_edge_us"].values()) == got["idle_us"]
    assert got["kernels_per_forward"] == 3.0


def test_product_variants_patch_and_restore_the_settings(probe):
    """The variants that leave more products to their consumers set overlap.FUSED_PROJECTIONS and
    fused_lora_kernels.RMS_SPLIT only inside, and every variant has its description."""
    from loraplex.ops.fused import lora_kernels as fused_lora_kernels
    from loraplex.ops.lora import overlap
    before = (overlap.FUSED_PROJECTIONS, fused_lora_kernels.RMS_SPLIT, overlap.FUSED_MIN_ROWS)
    with probe.variant("od_split1024"):
        assert overlap.FUSED_PROJECTIONS == {"q_proj", "o_proj", "down_proj"} and fused_lora_kernels.RMS_SPLIT == 1024
        assert overlap.fused_projections(1, decode=True) == overlap.FUSED_PROJECTIONS   # at any batch
    with probe.variant("q_only"):
        assert overlap.FUSED_PROJECTIONS == {"q_proj"} and fused_lora_kernels.RMS_SPLIT == 0
    from loraplex.models import llama
    with probe.variant("all_split512"):
        assert "gate_proj" in overlap.FUSED_PROJECTIONS and fused_lora_kernels.RMS_SPLIT == 512
        assert not llama.FUSED_BOUNDARIES
    with probe.variant("boundary_od1024"):
        assert llama.FUSED_BOUNDARIES and fused_lora_kernels.RMS_SPLIT == 1024 and not llama.DOWN_SHRINK_IN_SILU
    with probe.variant("boundary_od1024_silu"):
        assert llama.FUSED_BOUNDARIES and llama.DOWN_SHRINK_IN_SILU
    with probe.variant("o_in_attention"):   # o's shrink in the attention only where o is not a fused projection
        assert llama.O_SHRINK_IN_ATTENTION and not llama.DOWN_SHRINK_IN_SILU and overlap.FUSED_PROJECTIONS == {"q_proj"}
    with probe.variant("o_in_attention_silu"):
        assert llama.O_SHRINK_IN_ATTENTION and llama.DOWN_SHRINK_IN_SILU
    # as they were measured: gate/up's product not added to SiLU at 5-32 decode rows (overlap.DECODE_EXTRA_FUSED)
    for name in ("od_split512", "down_in_silu", "o_in_attention", "no_gate"):
        with probe.variant(name):
            assert "gate_proj" not in overlap.fused_projections(32, decode=True), name
    assert "gate_proj" in overlap.fused_projections(32, decode=True)   # today's default
    from loraplex.ops.gemm import skinny as skinny_gemm
    setting = skinny_gemm.SETTING
    with probe.variant("backbone+skinny"):
        assert skinny_gemm.SETTING == "on"
    with probe.variant("backbone+cublas"):
        assert skinny_gemm.SETTING == "off"
    assert skinny_gemm.SETTING == setting
    from loraplex.ops.attention import kernels as attention_kernels
    with probe.variant("o_in_attention_late"):
        assert llama.O_SHRINK_IN_ATTENTION and not attention_kernels.LORA_PREFETCH_A
    assert attention_kernels.LORA_PREFETCH_A
    assert (overlap.FUSED_PROJECTIONS, fused_lora_kernels.RMS_SPLIT, overlap.FUSED_MIN_ROWS) == before
    assert not llama.FUSED_BOUNDARIES
    assert not llama.O_SHRINK_IN_ATTENTION and not llama.DOWN_SHRINK_IN_SILU
    with probe.variant("rope_heads2"):
        assert fused_lora_kernels.ROPE_HEADS == 2
    assert fused_lora_kernels.ROPE_HEADS == 4 and set(probe.ROPE_HEADS_VARIANTS) <= set(probe.VARIANTS)
    assert set(probe.PRODUCT_VARIANTS) <= set(probe.VARIANTS)
    assert probe.VARIANTS["od_rows"].endswith("one program per row") and "q/o/down" in probe.VARIANTS["od_rows"]


def test_paired_rounds_rotate_and_compare_within_a_round(probe):
    names = ["backbone", "fused", "o_in_attention"]
    orders = [probe.round_order(names, r) for r in range(3)]
    assert orders == [names, ["fused", "o_in_attention", "backbone"], ["o_in_attention", "backbone", "fused"]]
    assert [o[0] for o in orders] == names            # each variant first once, and last once
    # a drift of +10% a round: the ratio within each round stays 0.9 where the medians alone say 0.99
    times = {"fused": [100.0, 110.0, 121.0], "o_in_attention": [90.0, 99.0, 108.9], "backbone": [80.0, 80.0, 80.0]}
    got = probe.paired_summary(times)
    assert got["o_in_attention"] == dict(median_us=99.0, rounds=3, vs_fused=0.9)
    assert got["fused"] == dict(median_us=110.0, rounds=3)
    assert got["backbone"]["vs_fused"] == round(80 / 110, 4)
    assert probe.paired_summary({"a": [1.0]}) == {"a": dict(median_us=1.0, rounds=1)}   # no base: times only


def test_variants_compose_with_plus_and_priorities_follow_the_engine(probe, monkeypatch):
    """"a+b" applies both variants' patches (restored after); graphs are captured at the engine's priority
    (overlap.capture_priority, the default one without adapters) unless a priority variant sets the scheme;
    unknown names are refused by name."""
    from loraplex.models import llama
    from loraplex.ops.fused import lora_kernels as fused_lora_kernels
    from loraplex.ops.lora import overlap
    from loraplex.ops.lora import stream_priority
    monkeypatch.delenv("LORAPLEX_GRAPH_PRIORITY", raising=False)
    with probe.variant("graph_default+rope_heads2+o_in_attention"):
        assert fused_lora_kernels.ROPE_HEADS == 2 and llama.O_SHRINK_IN_ATTENTION
        assert overlap.SIDE_STREAM_PRIORITY == 0 and probe.capture_priority("graph_default") == 0
    with probe.variant("side_high+od_split1024"):
        assert overlap.SIDE_STREAM_PRIORITY == -5 and fused_lora_kernels.RMS_SPLIT == 1024
        assert probe.capture_priority("side_high+od_split1024") == 0
    with probe.variant("gemm_high"):
        assert stream_priority.capture_priority() == 0 and stream_priority.gemm_stream_priority() == -5
    assert fused_lora_kernels.ROPE_HEADS == 4 and not llama.O_SHRINK_IN_ATTENTION
    assert overlap.SIDE_STREAM_PRIORITY == 0 and fused_lora_kernels.RMS_SPLIT != 1024
    assert "LORAPLEX_GRAPH_PRIORITY" not in os.environ
    monkeypatch.setenv("LORAPLEX_LORA_OVERLAP", "fused")
    for name in ("full+graph_default", "graph_default+full"):   # both env settings inside, both restored after
        with probe.variant(name):
            assert os.environ["LORAPLEX_LORA_OVERLAP"] == "full" and stream_priority.priority_scheme() == "default"
        assert os.environ["LORAPLEX_LORA_OVERLAP"] == "fused" and "LORAPLEX_GRAPH_PRIORITY" not in os.environ
    assert probe.capture_priority("fused") == -5 and stream_priority.gemm_stream_priority() is None
    assert probe.capture_priority("backbone") == 0 and probe.is_backbone("backbone+graph_high")
    with probe.variant("backbone+graph_high"):
        assert probe.capture_priority("backbone+graph_high") == -5
    assert not probe.is_backbone("fused+rope_heads2")
    assert probe.describe("graph_default+rope_heads2").count(" + ") == 1
    with pytest.raises(ValueError, match="rope_heads3"):
        probe.describe("fused+rope_heads3")

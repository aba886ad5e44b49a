"""Which CUDA graphs the engine captures, and which one runs a step (engine/cuda_graphs.py's GraphShapes:
host only, so tested on the CPU; the replays themselves are GPU tests)."""
from __future__ import annotations

import pytest

from loraplex.engine.cuda_graphs import GraphShapes, graph_buckets, mixed_buckets
from loraplex.models.forward_batch import SequenceChunk


def decode(n: int, cached: int = 10) -> list[SequenceChunk]:
    return [SequenceChunk([1], cached, [0]) for _ in range(n)]


def prompt(n: int, cached: int = 0) -> SequenceChunk:
    return SequenceChunk([1] * n, cached, [0])


def test_buckets():
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert mixed_buckets(32, 256) == ([16, 32], [16, 32, 64, 128, 256])
    assert mixed_buckets(256, 100) == ([16, 32, 64, 128, 256], [16, 32, 64, 100])
    assert mixed_buckets(10, 16) == ([10], [16])
    assert mixed_buckets(32, 0) == ([], [])


def test_every_shape_is_listed_once_most_rows_first():
    shapes = GraphShapes.make(32, 1024, 64)
    listed = shapes.all()
    assert len(listed) == len(set(listed)) == 6 + 2 * 3
    rows = [s + p for s, p in listed]
    assert rows == sorted(rows, reverse=True) and listed[0] == (32, 64)
    assert GraphShapes.make(32, 1024, 0).all() == [(b, 0) for b in (32, 16, 8, 4, 2, 1)]


@pytest.mark.parametrize("chunks, key", [
    (decode(1), (1, 0)), (decode(3), (4, 0)), (decode(17), (32, 0)), (decode(33), None),
    (decode(5) + [prompt(7)], (16, 16)),          # a prompt chunk beside decodes: a mixed graph
    ([prompt(1)], (1, 0)),                        # a one-token prompt is a row like a decode
    ([prompt(17)], (16, 32)),
    (decode(20) + [prompt(30), prompt(30)], (32, 64)),
    (decode(31) + [prompt(64)], (32, 64)),
    (decode(31) + [prompt(65)], None),            # more prompt tokens than any graph holds: eager
    (decode(32) + [prompt(2)], None),             # more sequences than any graph holds: eager
    (decode(2, cached=1023) + [prompt(2)], (16, 16)),
    (decode(2, cached=1024), None),               # a context past max_seq_len: eager
    ([prompt(3, cached=1022)], None),
])
def test_the_smallest_graph_that_holds_the_step_runs_it(chunks, key):
    assert GraphShapes.make(32, 1024, 64).key_for(chunks) == key


def test_without_mixed_graphs_only_decodes_replay():
    shapes = GraphShapes.make(32, 1024, 0)
    assert shapes.key_for(decode(7)) == (8, 0)
    assert shapes.key_for(decode(7) + [prompt(2)]) is None


@pytest.mark.parametrize("auto", [False, True])
def test_which_lora_variant_replays(auto):
    """No adapter: the graph without LoRA; LORAPLEX_LORA_ROWWISE=auto: decode steps whose adapters make only
    small tiles (sgmv.rows_fit) replay the "rows" graph, others and mixed steps the plain one."""
    from loraplex.engine.cuda_graphs import StepGraphs
    graphs = StepGraphs.__new__(StepGraphs)   # no CUDA here: only the host-side choice
    graphs.pool, graphs.rows_variant = object(), auto

    def with_slots(chunks, slots):
        return [SequenceChunk(c.token_ids, c.num_cached, c.block_table, s) for c, s in zip(chunks, slots)]
    rows = "rows" if auto else True
    assert graphs.lora_variant(with_slots(decode(3), [-1, -1, -1]), (4, 0)) is False
    assert graphs.lora_variant(with_slots(decode(6), [0, 1, 2, 3, 4, -1]), (8, 0)) == rows
    assert graphs.lora_variant(with_slots(decode(5), [7] * 4 + [-1]), (8, 0)) == rows
    assert graphs.lora_variant(with_slots(decode(5), [7] * 5), (8, 0)) is True      # a 5-row tile
    assert graphs.lora_variant(with_slots(decode(2) + [prompt(20)], [0, 1, 2]), (16, 32)) is True   # mixed
    graphs.pool = None
    assert graphs.lora_variant(with_slots(decode(2), [0, 1]), (2, 0)) is False


@pytest.mark.parametrize("auto", [False, True])
def test_eager_decode_steps_choose_as_their_graphs_would(auto, monkeypatch):
    """With LORAPLEX_LORA_ROWWISE=auto an eager decode step whose adapters fit runs the row-wise kernels
    (sgmv.decode_rowwise(2)); prompt chunks, a 5-row adapter or ranks above 32 keep the tile product."""
    from types import SimpleNamespace

    from loraplex.engine.model_runner import ModelRunner
    from loraplex.ops.lora import sgmv
    monkeypatch.setattr(sgmv, "ROWWISE_AUTO", auto)

    def mode(chunks, max_rank=16):
        runner = SimpleNamespace(adapters=SimpleNamespace(pool=SimpleNamespace(max_rank=max_rank)))
        with ModelRunner._rowwise(runner, chunks):
            return sgmv.config_for(16).expand_rowwise

    def with_slots(chunks, slots):
        return [SequenceChunk(c.token_ids, c.num_cached, c.block_table, s) for c, s in zip(chunks, slots)]
    base = sgmv.config_for(16).expand_rowwise
    assert mode(with_slots(decode(4), [0, 1, 2, -1])) == (2 if auto else base)
    assert mode(with_slots(decode(4), [0, 1, 2, -1]), max_rank=64) == base
    assert mode(with_slots(decode(5), [3] * 5)) == base
    assert mode(with_slots(decode(1) + [prompt(9)], [0, 1])) == base


def test_gemm_counts_and_the_in_gemm_variant():
    """EngineConfig.lora_in_gemm: decode graphs per count of active adapters (1, 2, 4, ... and the most a
    shape can meet); a decode step whose adapters the runner put in the area replays the smallest count that
    holds them; mixed steps, and steps without adapters, do not."""
    from types import SimpleNamespace

    from loraplex.engine.cuda_graphs import StepGraphs, gemm_count_for, gemm_counts
    assert gemm_counts(1, 32) == [1]
    assert gemm_counts(8, 32) == [1, 2, 4, 8]
    assert gemm_counts(48, 32) == [1, 2, 4, 8, 16, 32]
    assert gemm_counts(48, 24) == [1, 2, 4, 8, 16, 24]
    assert gemm_counts(6, 4) == [1, 2, 4]
    assert gemm_counts(4, 0) == []
    assert [gemm_count_for(n, 48, 24) for n in (1, 3, 9, 17, 24, 25)] == [1, 4, 16, 24, 24, None]
    assert gemm_count_for(5, 8, 32) == 8 and gemm_count_for(9, 8, 32) is None
    graphs = StepGraphs.__new__(StepGraphs)   # no CUDA here: only the host-side choice
    graphs.pool, graphs.rows_variant, graphs.area = object(), False, SimpleNamespace(capacity=24)

    def with_slots(chunks, slots):
        return [SequenceChunk(c.token_ids, c.num_cached, c.block_table, s) for c, s in zip(chunks, slots)]
    step = with_slots(decode(6), [0, 1, 2, 0, -1, 5])
    assert graphs.lora_variant(step, (8, 0), in_gemm=4) == ("gemm", 4)
    assert graphs.lora_variant(step, (8, 0), in_gemm=3) == ("gemm", 4)
    assert graphs.lora_variant(step, (8, 0)) is True                       # the runner did not update the area
    assert graphs.lora_variant(with_slots(decode(20), list(range(20))), (32, 0), in_gemm=20) == ("gemm", 24)
    assert graphs.lora_variant(with_slots(decode(2) + [prompt(9)], [0, 1, 2]), (16, 16), in_gemm=3) is True
    assert graphs.lora_variant(with_slots(decode(3), [-1] * 3), (4, 0), in_gemm=None) is False
    graphs.area = None
    assert graphs.lora_variant(step, (8, 0), in_gemm=4) is True


@pytest.mark.parametrize("scheme", ["high", "gemm", "default"])
def test_capture_priority_only_where_lora_kernels_run_beside(scheme, monkeypatch):
    """StepGraphs._priority: a graph is captured above the default priority only under "high" and only where its
    forward runs LoRA kernels on the side stream (overlap.lora_path "...-side": up to SHRINK_MAX_ROWS rows);
    graphs without adapters, with LoRA inside the GEMMs, or of more rows have nothing to order."""
    from loraplex.engine.cuda_graphs import StepGraphs
    from loraplex.ops.lora import overlap
    monkeypatch.setenv("LORAPLEX_GRAPH_PRIORITY", scheme)
    monkeypatch.delenv("LORAPLEX_LORA_OVERLAP", raising=False)
    high = -5 if scheme == "high" else 0
    assert StepGraphs._priority(True, 32) == StepGraphs._priority("rows", 8) == high
    assert StepGraphs._priority(True, overlap.SHRINK_MAX_ROWS) == high          # mixed: shrink beside the GEMM
    assert StepGraphs._priority(True, overlap.SHRINK_MAX_ROWS + 1) == 0         # plain order, one stream
    assert StepGraphs._priority(False, 32) == StepGraphs._priority(("gemm", 4), 32) == 0
    monkeypatch.setenv("LORAPLEX_LORA_OVERLAP", "off")
    assert StepGraphs._priority(True, 32) == 0

"""Which CUDA graphs the engine captures, and which one runs a step (engine/cuda_graphs.py's GraphShapes:
host only, so tested on the CPU; the replays themselves are GPU tests)."""
from __future__ import annotations

import random

import pytest

from loraplex.engine.cuda_graphs import GraphShapes, graph_buckets, mixed_buckets
from loraplex.models.forward_batch import ForwardBatch, SequenceChunk


def decode(n: int, cached: int = 10) -> list[SequenceChunk]:
    return [SequenceChunk([1], cached, [0]) for _ in range(n)]


def prompt(n: int, cached: int = 0) -> SequenceChunk:
    return SequenceChunk([1] * n, cached, [0])


def test_buckets():
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert graph_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert mixed_buckets(32, 256) == ([16, 32], [16, 32, 64, 128, 256], [])
    assert mixed_buckets(256, 100) == ([16, 32, 64, 128, 256], [16, 32, 64, 100], [])
    assert mixed_buckets(10, 16) == ([10], [16], [])
    assert mixed_buckets(32, 0) == ([], [], [])
    # past 256 prompt tokens: the largest sequence bucket only, every 128 tokens, its rows up to max_rows
    assert mixed_buckets(32, 2048, 2048) == ([16, 32], [16, 32, 64, 128, 256], [*range(384, 1921, 128), 2016])
    assert mixed_buckets(256, 2048, 2048) == ([16, 32, 64, 128, 256], [16, 32, 64, 128, 256],
                                              [*range(384, 1665, 128), 1792])
    assert mixed_buckets(32, 700) == ([16, 32], [16, 32, 64, 128, 256], [384, 512, 640, 700])
    assert mixed_buckets(32, 384, 4096) == ([16, 32], [16, 32, 64, 128, 256], [384])
    assert mixed_buckets(256, 2048, 512) == ([16, 32, 64, 128, 256], [16, 32, 64, 128, 256], [])


def test_large_prompt_steps_take_the_fewest_rows_that_hold_them():
    """Decodes and prompt chunks share a graph's rows: a step pads to the next 128 rows past 256 prompt tokens,
    whatever its number of sequences."""
    shapes = GraphShapes.make(32, 4096, 2048, 2048)
    assert shapes.key_for(decode(20) + [prompt(1337)]) == (32, 1408)   # 1,357 rows in 1,440
    assert shapes.key_for(decode(8) + [prompt(257)]) == (16, 256)      # 265 rows in 272
    assert shapes.key_for([prompt(280)]) == (32, 256)                  # 280 rows in 288
    assert shapes.key_for([prompt(300)]) == (32, 384)                  # 300 rows in 416
    assert shapes.key_for(decode(2) + [prompt(1000), prompt(1046)]) == (32, 2016)   # 2,048 rows: the budget
    assert shapes.key_for([prompt(2049)]) is None                      # more prompt tokens than graphs take
    assert shapes.largest_graph_rows() == 2048
    assert GraphShapes.make(32, 4096, 256, 2048).key_for([prompt(257)]) is None


@pytest.mark.parametrize("batch, prompt_tokens, budget, rows", [
    (256, 2048, 2048, 2048), (32, 2048, 2048, 2048),   # the defaults: the wide graphs reach the step budget
    (256, 256, 2048, 512), (256, 0, 2048, 256),         # no wide graphs; decode graphs only
    (32, 2048, 8192, 2080),                              # prompt tokens bound them below a larger budget
    (256, 2048, 300, 320), (16, 128, 128, 144)])         # a budget below the small buckets: the first to reach it
def test_the_largest_graph_holds_at_most_a_steps_rows(batch, prompt_tokens, budget, rows):
    """What the KV budget sizes the graphs' memory pool by (engine/model_runner.py)."""
    assert GraphShapes.make(batch, 4096, prompt_tokens, budget).largest_graph_rows() == rows


def test_shapes_that_another_outdoes_are_not_captured():
    """A shape is left out where another holds every step it holds in fewer rows (steps hold at most the budget's
    rows), or in as many with room for more sequences: with a budget of 300 rows, (256, 64) leaves out every shape
    past 320 rows, and (32, 16) leaves out (16, 32)."""
    shapes = GraphShapes.make(256, 4096, 2048, 300)
    assert [sp for sp in shapes.all() if sp[1]] == [(256, 64), (256, 32), (256, 16), (128, 128), (128, 64), (128, 32),
                                                    (128, 16), (64, 64), (64, 32), (64, 16), (32, 32), (32, 16),
                                                    (16, 16)]
    assert shapes.largest_graph_rows() == 320
    # the defaults: 20 decode shapes, 5 × 5 small mixed ones but the 10 (s, p) with s < p that (p, s) outdoes, and
    # 12 wide ones
    assert len(GraphShapes.make(256, 4096, 2048, 2048).all()) == 20 + 25 - 10 + 12


def test_every_shape_is_listed_once_most_rows_first():
    shapes = GraphShapes.make(32, 1024, 64)
    listed = shapes.all()
    assert len(listed) == len(set(listed)) == 6 + 2 * 3 - 1   # (32, 16) outdoes (16, 32)
    rows = [s + p for s, p in listed]
    assert rows == sorted(rows, reverse=True) and listed[0] == (32, 64)
    assert GraphShapes.make(32, 1024, 0).all() == [(b, 0) for b in (32, 16, 8, 4, 2, 1)]


@pytest.mark.parametrize("chunks, key", [
    (decode(1), (1, 0)), (decode(3), (4, 0)), (decode(17), (32, 0)), (decode(33), None),
    (decode(5) + [prompt(7)], (16, 16)),          # a prompt chunk beside decodes: a mixed graph
    ([prompt(1)], (1, 0)),                        # a one-token prompt is a row like a decode
    ([prompt(17)], (16, 16)),                     # 17 rows in 32: prompt chunks take the rows decodes leave
    ([prompt(40)], (32, 16)),
    (decode(10) + [prompt(22)], (16, 16)),
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


def test_capture_priority_only_where_lora_kernels_run_beside():
    """LlamaForCausalLM.graph_stream_priority: a graph is captured above the default priority only where its forward
    runs LoRA kernels on the side stream (up to lora_plan.BESIDE_MAX_ROWS rows), so that the GEMMs go first; graphs
    without adapters, or of more rows, have nothing to order."""
    from loraplex.models.llama import LlamaForCausalLM
    from loraplex.models.lora_plan import BESIDE_MAX_ROWS
    from loraplex.ops.lora import overlap
    priority = LlamaForCausalLM.graph_stream_priority
    assert overlap.CAPTURE_PRIORITY < overlap.SIDE_STREAM_PRIORITY == 0
    assert priority(None, 32, True) == priority(None, BESIDE_MAX_ROWS, True) == overlap.CAPTURE_PRIORITY
    assert priority(None, BESIDE_MAX_ROWS + 1, True) == 0         # plain order, one stream
    assert priority(None, 32, False) == 0


def _random_step(rng: random.Random, max_batch: int, max_rows: int) -> list[SequenceChunk]:
    """Up to `max_batch` sequences of up to `max_rows` rows together: decodes, and prompt chunks of 2 to 2,048."""
    n = rng.randint(1, max_batch)
    decodes = rng.randint(max(0, n - (max_rows - n) // 2 - 1), n) if max_rows < 3 * n else rng.randint(0, n)
    lens, left = [1] * decodes, max_rows - decodes
    for i in range(n - decodes):
        most = left - 2 * (n - decodes - i - 1)
        if most < 2:
            break
        lens.append(rng.randint(2, min(most, rng.choice([2, 17, 300, 2048]))))
        left -= lens[-1]
    chunks, first = [], 0
    for m in lens:   # each sequence in blocks of its own
        cached = rng.randint(1, 60) if m == 1 else 0
        blocks = -(-(cached + m) // 16)
        chunks.append(SequenceChunk([1] * m, cached, list(range(first, first + blocks))))
        first += blocks
    return chunks


@pytest.mark.parametrize("max_batch, prompt_tokens, max_rows", [
    (256, 2048, 2048), (32, 2048, 2048), (32, 2048, 8192), (16, 300, 300), (256, 2048, 300), (10, 16, 10),
    (1, 2048, 2048)])
def test_every_step_a_shape_holds_takes_one_and_fits_its_graph_batch(max_batch, prompt_tokens, max_rows):
    """key_for against the graph batches themselves: a step gets a shape whenever one holds it (its sequences, its
    rows, its prompt tokens within the limit), and the graph batch of that shape takes it (ForwardBatch.update_)."""
    rng = random.Random(max_batch * 7 + max_rows)
    shapes = GraphShapes.make(max_batch, 4096, prompt_tokens, max_rows)
    batches: dict = {}
    for _ in range(150):
        chunks = _random_step(rng, max_batch, max_rows)
        lens = [len(c.token_ids) for c in chunks]
        prompt, rows = sum(m for m in lens if m > 1), sum(lens)
        key = shapes.key_for(chunks)
        holders = [(s, p) for s, p in shapes.all() if s >= len(chunks) and s + p >= rows and (p > 0) == (prompt > 0)]
        if prompt > prompt_tokens or not holders:
            assert key is None, (lens, key)
            continue
        assert key is not None and key[0] + key[1] == min(s + p for s, p in holders), (lens, key)
        if key not in batches:
            batches[key] = ForwardBatch.for_graph(key[0], 4096, block_size=16, num_blocks=1 << 16, vocab_size=4,
                                                  num_adapter_slots=1, device="cpu", max_prompt_tokens=key[1])
        batches[key].update_(chunks)

"""`ForwardBatch.build`: the flat layout every layer reads, and the errors for bad sequences."""
from __future__ import annotations

import pytest
import torch

from loraplex.models import ForwardBatch, KVCache, ModelConfig, SequenceChunk
from loraplex.models.forward_batch import TABLE_ALIGN

BS = 8


def build(chunks, num_blocks=32, vocab=100, slots=None):
    return ForwardBatch.build(chunks, block_size=BS, num_blocks=num_blocks, vocab_size=vocab,
                              num_adapter_slots=slots)


def test_layout_of_a_mixed_batch():
    chunks = [SequenceChunk([5, 6, 7], 0, [4], adapter_slot=2),           # prompt of 3
              SequenceChunk([9], 17, [1, 7, 3], adapter_slot=-1),          # decode at position 17
              SequenceChunk([1, 2, 3, 4], 6, [11, 12], 0, needs_logits=False)]  # chunk over a prefix of 6
    b = build(chunks)
    assert b.input_ids.tolist() == [5, 6, 7, 9, 1, 2, 3, 4]
    assert b.positions.tolist() == [0, 1, 2, 17, 6, 7, 8, 9]
    # slot = block_table[pos // 8] * 8 + pos % 8
    assert b.slot_mapping.tolist() == [32, 33, 34, 3 * 8 + 1, 11 * 8 + 6, 11 * 8 + 7, 12 * 8 + 0, 12 * 8 + 1]
    assert b.query_start.tolist() == [0, 3, 4, 8]
    assert b.seq_lens.tolist() == [3, 18, 10]
    # 3 blocks at most, padded to TABLE_ALIGN columns (one stride class for the attention kernels)
    assert b.block_tables.shape == (3, TABLE_ALIGN)
    assert b.block_tables[1, :3].tolist() == [1, 7, 3] and b.block_tables[2, :2].tolist() == [11, 12]
    assert b.logits_rows.tolist() == [2, 3] and b.logits_seqs == (0, 1)
    assert (b.max_query_len, b.max_seq_len, b.num_tokens, b.has_adapters) == (4, 18, 8, True)
    assert b.lora.seg_indptr.tolist() == [0, 3, 4, 8] and b.lora.slot_ids.tolist() == [2, -1, 0]
    for t in (b.input_ids, b.positions, b.slot_mapping, b.query_start, b.seq_lens, b.block_tables):
        assert t.dtype == torch.int32
    # one transfer: the LoraBatch's arrays live in the same device buffer
    storage = b.input_ids.untyped_storage().data_ptr()
    assert b.lora.seg_indptr.untyped_storage().data_ptr() == storage
    assert b.lora.work_end.untyped_storage().data_ptr() == storage


def test_blocks_past_the_context_are_not_sent_or_checked():
    b = build([SequenceChunk([1], 0, [3, 10**9])])  # the second block is not needed yet
    assert b.block_tables.tolist() == [[3] + [0] * (TABLE_ALIGN - 1)]   # padding columns are 0, never read
    assert not build([SequenceChunk([1], 0, [3])], slots=4).has_adapters


@pytest.mark.parametrize("chunk, message", [
    (SequenceChunk([], 0, [0]), r"sequence 1: token_ids must be a non-empty list"),
    (SequenceChunk([1, 100], 0, [0]), r"sequence 1: token_ids\[1\] = 100 is outside the vocabulary \[0, 100\)"),
    (SequenceChunk([1, -1], 0, [0]), r"token_ids\[1\] = -1"),
    (SequenceChunk([1.5], 0, [0]), r"token_ids must be a non-empty list of ints"),
    (SequenceChunk([1], -2, [0]), r"num_cached must be an int >= 0"),
    (SequenceChunk([1] * 3, 6, [0]), r"6 cached \+ 3 new tokens need 2 blocks of 8; its block_table has 1"),
    (SequenceChunk([1], 8, [0, 32]), r"block_table\[1\] = 32 is outside the cache's 32 blocks"),
    (SequenceChunk([1], 0, [0], adapter_slot=4), r"adapter_slot must be -1 or a slot below 4, got 4"),
    (SequenceChunk([1], 0, [0], adapter_slot=-3), r"adapter_slot must be -1 or a slot below 4"),
    (SequenceChunk([1], 0, [0], adapter_slot=True), r"adapter_slot must be -1 or a slot below 4, got True"),
    (SequenceChunk([1], True, [0]), r"num_cached must be an int >= 0, got True"),
    (SequenceChunk([1], 0, [0], needs_logits="no"), r"needs_logits must be a bool, got 'no'"),
    (SequenceChunk([1], 0, None), r"block_table must be a flat list of block ids, got None"),
    (SequenceChunk([1], 0, [0.7]), r"block_table must be a flat list of block ids"),
    (SequenceChunk([1], 0, [[0]]), r"block_table must be a flat list of block ids"),
])
def test_bad_sequences_are_named(chunk, message):
    with pytest.raises(ValueError, match=message):
        build([SequenceChunk([1], 0, [1]), chunk], slots=4)


@pytest.mark.parametrize("seed", range(5))
def test_plain_chunks_checked_in_bulk_lay_out_as_checked_one_by_one(seed, monkeypatch):
    """_layout's bulk check (lists of ints, as the engine makes them) gives the arrays the chunk-by-chunk
    check gives, and leaves other forms (numpy ids and tables, numpy ints) to it."""
    import numpy as np
    from loraplex.models import forward_batch as fb
    rng = np.random.default_rng(seed)
    order = rng.permutation(200).tolist()
    chunks, start = [], 0
    for i in range(int(rng.integers(1, 40))):
        cached, new = int(rng.integers(0, 40)), int(rng.integers(1, 20)) if i % 3 == 0 else 1
        blocks = -(-(cached + new) // 8) + int(rng.integers(0, 3))   # tables may run past the context
        ids, table = rng.integers(0, 100, new).tolist(), order[start:start + blocks]
        start += blocks
        if i % 5 == 4:   # other forms: numpy arrays and ints, a tuple
            ids, table, cached = np.array(ids), tuple(np.array(table, dtype=np.int32)), np.int64(cached)
        chunks.append(SequenceChunk(ids, cached, table, int(rng.integers(-1, 4)), bool(i % 7)))
    bulk = fb._layout(chunks, 8, 200, 100, 4)
    one_by_one = fb._layout(chunks, 8, 200, 100, 4, fast=False)
    assert bulk.keys() == one_by_one.keys()
    for key, value in bulk.items():
        assert np.array_equal(value, one_by_one[key]) if isinstance(value, np.ndarray) else value == one_by_one[key]
    plain = [c for i, c in enumerate(chunks) if i % 5 != 4]
    monkeypatch.setattr(fb, "_check_chunk", None)   # plain chunks never reach it
    fb._layout(plain, 8, 200, 100, 4)


@pytest.mark.parametrize("chunks", [
    [SequenceChunk([True], 0, [1]), SequenceChunk([5], 0, [2])],        # a chunk of bools beside ints
    [SequenceChunk([3], 0, [True]), SequenceChunk([5], 0, [2])],
    [SequenceChunk([3], 0, [1, 2.5])], [SequenceChunk([3], 0, [1, None])],   # junk past the covered blocks
    [SequenceChunk([2**63], 0, [1])], [SequenceChunk([3], 0, [2**64])],   # past int64
    [SequenceChunk([1], 2**63 - 2, [3])],                                 # a context past int64's blocks
    [SequenceChunk([1], 0, [1], needs_logits=1)], [SequenceChunk([-0], 0, [1])],
], ids=lambda chunks: repr(chunks)[:60])
def test_the_bulk_check_refuses_or_accepts_what_the_per_chunk_check_does(chunks):
    import numpy as np
    from loraplex.models import forward_batch as fb

    def outcome(fast):
        try:
            return fb._layout(chunks, 4, 64, 100, 4, fast=fast)
        except ValueError as e:
            return str(e)
    bulk, one_by_one = outcome(True), outcome(False)
    if isinstance(one_by_one, str):
        assert bulk == one_by_one
    else:
        assert all(np.array_equal(v, one_by_one[k]) if isinstance(v, np.ndarray) else v == one_by_one[k]
                   for k, v in bulk.items())


def test_two_tokens_in_one_kv_slot_are_refused():
    with pytest.raises(ValueError, match=r"sequences 0 and 1 write the same KV slot 42 \(block 5\)"):
        build([SequenceChunk([1], 2, [5]), SequenceChunk([1, 2], 1, [5])])


@pytest.mark.parametrize("field", ["block_size", "num_blocks", "vocab_size"])
def test_bad_geometry_is_refused(field):
    kwargs = dict(block_size=BS, num_blocks=8, vocab_size=100)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        ForwardBatch.build([SequenceChunk([1], 0, [1])], **kwargs)


def test_graph_batch_is_rewritten_in_place_with_padding():
    g = ForwardBatch.for_graph(4, 40, block_size=BS, num_blocks=32, vocab_size=100, num_adapter_slots=3,
                               device="cpu")
    ptrs = [t.data_ptr() for t in (g.input_ids, g.block_tables, g.lora.seg_indptr)]
    g.update_([SequenceChunk([7], 17, [1, 7, 3], 2), SequenceChunk([9], 0, [4], -1)])
    assert [t.data_ptr() for t in (g.input_ids, g.block_tables, g.lora.seg_indptr)] == ptrs
    assert g.input_ids.tolist() == [7, 9, 0, 0] and g.positions.tolist() == [17, 0, 0, 0]
    assert g.slot_mapping.tolist() == [3 * 8 + 1, 4 * 8, -1, -1]
    assert g.query_start.tolist() == [0, 1, 2, 2, 2] and g.seq_lens.tolist() == [18, 1, 0, 0]
    assert g.block_tables.shape == (4, TABLE_ALIGN) and g.block_tables[0, :3].tolist() == [1, 7, 3]
    assert g.logits_rows.tolist() == [0, 1, 0, 0] and g.logits_seqs == (0, 1)
    assert g.has_adapters and g.max_query_len == 1 and g.max_seq_len == 40 and g.num_tokens == 4
    with pytest.raises(ValueError, match="a graph batch takes decode chunks of one token"):
        g.update_([SequenceChunk([7, 8], 0, [1])])
    with pytest.raises(ValueError, match="context 41 exceeds the graph batch's max_seq_len=40"):
        g.update_([SequenceChunk([7], 40, [1, 2, 3, 4, 5, 6])])
    with pytest.raises(ValueError, match="a graph batch for 4 sequences got 5"):
        g.update_([SequenceChunk([1], 0, [i]) for i in range(5)])
    with pytest.raises(ValueError, match="adapter_slot must be -1 or a slot below 3"):
        g.update_([SequenceChunk([1], 0, [0], 3)])
    with pytest.raises(ValueError, match="update_ needs a batch made by ForwardBatch.for_graph"):
        build([SequenceChunk([1], 0, [1])]).update_([SequenceChunk([1], 0, [1])])


def test_mixed_graph_batch_holds_prompt_chunks_beside_decodes():
    """A graph batch with room for prompt tokens: rows, sequences and logits rows padded to fixed sizes,
    the logits rows those of the chunks that need logits, in order."""
    g = ForwardBatch.for_graph(4, 40, block_size=BS, num_blocks=32, vocab_size=100, num_adapter_slots=3,
                               device="cpu", max_prompt_tokens=8)
    assert g.num_tokens == 12 and g.max_query_len == 12 and g.input_ids.shape == (12,)
    ptrs = [t.data_ptr() for t in (g.input_ids, g.logits_rows, g.lora.row_slot)]
    chunks = [SequenceChunk([7], 17, [1, 7, 3], 2),                        # a decode
              SequenceChunk([1, 2, 3, 4, 5], 0, [4], 1, needs_logits=False),  # a prompt's first chunk
              SequenceChunk([6, 5, 4], 8, [5, 6], -1)]                       # a prompt's last chunk
    g.update_(chunks)
    assert [t.data_ptr() for t in (g.input_ids, g.logits_rows, g.lora.row_slot)] == ptrs
    assert g.input_ids.tolist() == [7, 1, 2, 3, 4, 5, 6, 5, 4, 0, 0, 0]
    assert g.positions.tolist() == [17, 0, 1, 2, 3, 4, 8, 9, 10, 0, 0, 0]
    assert g.slot_mapping.tolist() == [3 * 8 + 1, 32, 33, 34, 35, 36, 48, 49, 50, -1, -1, -1]
    assert g.query_start.tolist() == [0, 1, 6, 9, 9] and g.seq_lens.tolist() == [18, 5, 11, 0]
    assert g.logits_rows.tolist() == [0, 8, 0, 0] and g.logits_seqs == (0, 2)
    assert g.lora.row_slot.tolist() == [2, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1]
    assert g.lora.num_rows == 12
    with pytest.raises(ValueError, match="a graph batch of 12 rows got chunks of 13 rows together"):
        g.update_([SequenceChunk([1] * 8, 0, [1]), SequenceChunk([1] * 4, 0, [2]), SequenceChunk([1], 3, [3])])
    g.update_([SequenceChunk([1] * 8, 0, [1])] + [SequenceChunk([1], 3, [i]) for i in (2, 3, 4)])  # full: 12 rows
    assert g.query_start.tolist() == [0, 8, 9, 10, 11] and g.logits_rows.tolist() == [7, 8, 9, 10]
    # prompt chunks take the rows the decodes leave: 11 prompt tokens beside one decode
    g.update_([SequenceChunk(list(range(1, 8)), 0, [1]), SequenceChunk([1], 3, [2]), SequenceChunk([9] * 4, 0, [3])])
    assert g.query_start.tolist() == [0, 7, 8, 12, 12] and g.input_ids.tolist() == [*range(1, 8), 1, 9, 9, 9, 9]
    assert g.slot_mapping.tolist()[-4:] == [3 * BS + i for i in range(4)] and g.seq_lens.tolist() == [7, 4, 4, 0]


def test_empty_batch_is_refused():
    with pytest.raises(ValueError, match="at least one sequence"):
        build([])


def test_kv_cache_sizes_and_errors():
    config = ModelConfig(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=100)
    per_block = KVCache.bytes_per_block(config, 16, torch.float16)
    assert per_block == 2 * 3 * 2 * 16 * 16 * 2
    kv = KVCache.for_memory(config, 10 * per_block + 5, 16, dtype=torch.float16)
    assert kv.num_blocks == 10 and kv.k[2].shape == (10, 16, 2, 16) and kv.k[1].is_contiguous()
    assert kv.k[0].data_ptr() != kv.v[0].data_ptr()
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        KVCache(config, 4, 12)
    with pytest.raises(ValueError, match="holds no block"):
        KVCache.for_memory(config, per_block - 1, 16, dtype=torch.float16)


def test_every_metadata_array_starts_16_byte_aligned():
    """Triton compiles a kernel variant per alignment of its pointer arguments: views that shift
    with the batch's sizes would recompile kernels mid-serving."""
    import random
    from loraplex.models.forward_batch import ForwardBatch, SequenceChunk
    rng = random.Random(0)
    for _ in range(20):
        chunks, next_block = [], 0
        for s in range(rng.randint(1, 7)):
            n, cached = rng.randint(1, 13), rng.randint(0, 20)
            blocks = -(-(n + cached) // 8)
            chunks.append(SequenceChunk([1] * n, cached, list(range(next_block, next_block + blocks)),
                                        rng.choice([-1, 0, 1]), rng.random() < 0.7))
            next_block += blocks
        b = ForwardBatch.build(chunks, block_size=8, num_blocks=next_block, vocab_size=10, num_adapter_slots=2)
        arrays = [b.input_ids, b.positions, b.slot_mapping, b.query_start, b.seq_lens, b.block_tables,
                  b.logits_rows, b.lora.seg_indptr, b.lora.slot_ids, b.lora.sorted_rows, b.lora.work_slot,
                  b.lora.work_start, b.lora.work_end]
        base = b.input_ids.data_ptr()
        assert all((t.data_ptr() - base) % 16 == 0 for t in arrays), [(t.data_ptr() - base) % 16 for t in arrays]


@pytest.mark.parametrize("context", [1, 8, 9, 16 * 8, 16 * 8 + 1, 40 * 8])
def test_block_table_stride_is_always_a_multiple_of_the_alignment(context):
    """Whatever the contexts, the attention kernels see one class of row stride (so eager steps never
    compile a new variant mid-run): a multiple of TABLE_ALIGN, in built and in graph batches."""
    blocks = -(-context // 8)
    b = ForwardBatch.build([SequenceChunk([1], context - 1, list(range(blocks)), -1)], block_size=8,
                           num_blocks=64, vocab_size=16)
    g = ForwardBatch.for_graph(2, context, block_size=8, num_blocks=64, vocab_size=16, num_adapter_slots=1,
                               device="cpu")
    for t in (b.block_tables, g.block_tables):
        assert t.stride(0) % TABLE_ALIGN == 0 and t.shape[1] >= blocks
    assert b.block_tables[0, :blocks].tolist() == list(range(blocks))


def test_batches_a_decode_graph_could_hold_take_its_tile_height():
    """Up to DECODE_MAX_ROWS rows a built batch uses the 16-row LoRA tiles of graph batches even when
    one adapter has more rows (so eager and replayed forwards run the same kernel settings)."""
    from loraplex.models.lora_plan import DECODE_MAX_ROWS
    from loraplex.ops.lora.batch import LARGE_BLOCK_M, SMALL_BLOCK_M
    rows = DECODE_MAX_ROWS
    shared = [SequenceChunk([1], 0, [i], 0) for i in range(rows)]
    assert build(shared, slots=1).lora.block_m == SMALL_BLOCK_M
    blocks = -(-rows // BS)
    prompt = [SequenceChunk([1] * rows, 0, list(range(blocks)), 0), SequenceChunk([1], 0, [blocks], 0)]
    assert build(prompt, slots=1).lora.block_m == LARGE_BLOCK_M   # rows + 1: the usual choice

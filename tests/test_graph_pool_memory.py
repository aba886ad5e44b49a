"""The KV budget's allowance for the CUDA graphs' pool (engine/model_runner.py): the fixed reserve, or the largest
graph's share of a profiled step's activations where that is more."""
import pytest

from loraplex.engine.model_runner import GRAPH_MEMORY_RESERVE, _profile_lens, graph_pool_bytes

MIB = 1 << 20


def test_small_graphs_keep_the_fixed_reserve():
    # decode graphs of 32 rows and mixed ones of 256 prompt tokens beside them, against a 2,048-row profile
    assert graph_pool_bytes(1536 * MIB, 2048, 32 + 256) == GRAPH_MEMORY_RESERVE


@pytest.mark.parametrize("activations_mib, graph_rows, want_mib", [(1536, 32 + 2048, 1560), (3000, 2048, 3000),
                                                                   (4096, 256 + 1024, 2560)])
def test_large_prompt_graphs_take_their_rows_share_of_the_activations(activations_mib, graph_rows, want_mib):
    assert graph_pool_bytes(activations_mib * MIB, 2048, graph_rows) == want_mib * MIB


def test_the_share_rounds_up_and_the_profile_must_have_rows():
    assert graph_pool_bytes(1000 * MIB + 1, 1000, 1000) == 1000 * MIB + 1
    assert graph_pool_bytes(3 * GRAPH_MEMORY_RESERVE + 1, 3, 2) == 2 * GRAPH_MEMORY_RESERVE + 1
    with pytest.raises(ValueError, match="profile_rows"):
        graph_pool_bytes(MIB, 0, 16)


def test_the_profile_step_spreads_its_tokens_over_its_sequences():
    assert _profile_lens(2048, 32) == [64] * 32
    assert _profile_lens(10, 4) == [3, 3, 2, 2]
    assert sum(_profile_lens(2049, 256)) == 2049

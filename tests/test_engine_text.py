"""Text in, text out: the tokenizer from the model folder, streamed text, stop strings."""
from __future__ import annotations

import pytest

from loraplex import LLM, SamplingParams
from model_fixtures import make_hf_model
from tokenizer_fixtures import make_tokenizer


@pytest.fixture(scope="module", params=["byte_bpe", "metaspace_bytefallback"])
def text_llm(request, tmp_path_factory):
    folder = make_hf_model(tmp_path_factory.mktemp("text") / "model", "llama-text", seed=5)
    make_tokenizer(folder, request.param, vocab_size=320)
    llm = LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=128, block_size=8, max_num_seqs=8,
              max_num_batched_tokens=64)
    yield llm
    llm.close()


def _stream(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[str], object]:
    engine = llm.engine
    engine.add_request("s", prompt, params)
    deltas, last = [], None
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.new_text)
            last = out
    return deltas, last


def test_text_matches_the_tokenizer_and_streams_whole_characters(text_llm):
    tok = text_llm.tokenizer
    prompts = ["Hello world", "Café crème", "你好，世界", "Numbers: 42"]
    outs = text_llm.generate(prompts, SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)
        full = tok.decode(out.prompt_token_ids + out.token_ids, skip_special_tokens=True)
        prompt_text = tok.decode(out.prompt_token_ids, skip_special_tokens=True)
        if full.startswith(prompt_text):
            assert out.text == full[len(prompt_text):]
        else:  # Llama-2-style byte tokens: sampled bytes merged with the prompt's last byte run
            assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    deltas, last = _stream(text_llm, "Emoji: ", SamplingParams(max_tokens=30, temperature=1.0, seed=9,
                                                                ignore_eos=True))
    assert "".join(deltas) == last.text
    if "\ufffd" not in last.text:
        assert not any("\ufffd" in d for d in deltas)


def test_stop_string_cuts_the_text_and_never_streams_part_of_it(text_llm):
    params = dict(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = text_llm.generate(["The quick brown"], SamplingParams(**params))[0]
    text = full.text
    assert len(text) > 12, "the model should produce some text"
    stop = text[6:9]
    cut = text.index(stop)
    deltas, last = _stream(text_llm, "The quick brown", SamplingParams(stop=[stop, "\x00never"], **params))
    assert last.text == text[:cut]
    assert last.finish_reason == "stop" and last.stop_reason == stop
    assert "".join(deltas) == text[:cut]
    assert full.token_ids[:len(last.token_ids)] == last.token_ids and len(last.token_ids) < len(full.token_ids)


def test_eos_from_the_tokenizer_stops(text_llm):
    tok = text_llm.tokenizer
    assert tok.eos_token_id in text_llm.engine.eos_token_ids
    out = text_llm.generate(["Hi"], SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[tok.eos_token_id],
                                                   ignore_eos=True))[0]
    assert out.finish_reason in ("stop", "length")

"""Streaming detokenization against the tokenizer's own `decode`, for byte-level BPE (GPT-2 / Llama 3),
Llama 2's Metaspace + byte-fallback layout, and a slow (pure Python) tokenizer; and stop strings: where the
text is cut, and that streamed deltas never leak a stop string."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from loraplex.engine.detokenizer import MAX_HELD_TOKENS, REPLACEMENT_CHAR, OutputText, load_tokenizer

from tokenizer_fixtures import BOS_ID, EOS_ID, KINDS, UNK_ID, make_tokenizer

MULTILINGUAL = (
    "Hello world! The quick brown fox, 42 times.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u00fcber Stra\u00dfe, ma\u00f1ana \u00c5ngstr\u00f6m.",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",
    "\u3053\u3093\u306b\u3061\u306f \ud55c\uad6d\uc5b4 mixed \u4e2d\u6587 text",
    "Emoji \U0001f600\U0001f680 \U0001f44d\U0001f3fd family \U0001f468\u200d\U0001f469\u200d\U0001f467 flag "
    "\U0001f1eb\U0001f1f7 \u2764\ufe0f!",
    "Tabs\tand\nnew lines\n\n  double  spaces, 3.14159 (x) [y] {z} <w>",
    "\U00010348 Gothic and \u00a0no-break \u2014 dash \u2026",
)
CJK_AND_EMOJI = "\u4f60\u597d\u4e16\u754c\u3053\u3093\u306b\u3061\u306f\ud55c\uad6d\U0001f600\U0001f680\U0001f44d\u2764"


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return {kind: make_tokenizer(tmp_path_factory.mktemp(kind), kind) for kind in KINDS}


@pytest.fixture(scope="module")
def toks(folders) -> dict[str, object]:
    return {kind: load_tokenizer(folder) for kind, folder in folders.items()}


@pytest.fixture(params=KINDS)
def tok(request, toks):
    return toks[request.param]


@pytest.fixture(scope="module")
def slow_tok():
    # ByT5's tokenizer is pure Python (no tokenizers backend), one token per UTF-8 byte, and drops
    # incomplete characters instead of writing U+FFFD.
    from transformers import ByT5Tokenizer
    return ByT5Tokenizer()


def stream(tokenizer, prompt: list[int], output: list[int], stop=(), skip_special_tokens: bool = True):
    """Feed `output` one token at a time, taking the new text after each; returns (out, deltas, stopped_at)
    where deltas[-1] is the final flush and stopped_at is (token index, stop string) or None."""
    out = OutputText(tokenizer, prompt, stop, skip_special_tokens)
    deltas, stopped_at = [], None
    for i, token in enumerate(output):
        matched = out.append(token)
        deltas.append(out.take_new())
        if matched is not None:
            stopped_at = (i, matched)
            break
    deltas.append(out.take_new(final=True))
    return out, deltas, stopped_at


def expected_text(tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> str:
    """The output's text as decoded after the prompt (so Metaspace's first space survives)."""
    before = tokenizer.decode(prompt, skip_special_tokens=skip)
    full = tokenizer.decode(prompt + output, skip_special_tokens=skip)
    assert full.startswith(before)
    return full[len(before):]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def byte_token_ids(tokenizer) -> set[int]:
    return {i for i in range(len(tokenizer)) if tokenizer.convert_ids_to_tokens(i).startswith("<0x")}


# ---- the fixture tokenizers -------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_fixture_is_a_real_tokenizer_folder(tmp_path, kind):
    folder = make_tokenizer(tmp_path / "a", kind)
    assert (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tok) <= 320
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id) == (UNK_ID, BOS_ID, EOS_ID)
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<unk>", "<s>", "</s>"]
    ids = tok.encode("Hello world")
    assert ids[0] == BOS_ID and BOS_ID not in ids[1:]
    for text in MULTILINGUAL:  # every character is reachable: byte symbols or byte-fallback tokens
        ids = tok.encode(text)
        assert UNK_ID not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text, kind
    # Deterministic, and vocab_size bounds the vocabulary.
    again = make_tokenizer(tmp_path / "b", kind)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == (again / name).read_bytes()
    smaller = AutoTokenizer.from_pretrained(make_tokenizer(tmp_path / "c", kind, vocab_size=290))
    assert len(smaller) <= 290 and len(smaller) < len(tok)
    with pytest.raises(ValueError, match="vocab_size"):
        make_tokenizer(tmp_path / "d", kind, vocab_size=259 if kind != "byte_bpe" else 258)


def test_fixture_kinds_differ_as_intended(toks):
    byte_bpe, meta = toks["byte_bpe"], toks["metaspace_bytefallback"]
    assert len(byte_token_ids(meta)) == 256 and not byte_token_ids(byte_bpe)
    # Metaspace strips the space it prepended; byte-level keeps text as is.
    assert meta.decode(encode(meta, "world")) == "world" and byte_bpe.decode(encode(byte_bpe, " world")) == " world"


def test_cjk_and_emoji_are_split_over_several_tokens(tok):
    # No single token spells any of these characters, so their first tokens are incomplete UTF-8.
    for i in range(len(tok)):
        piece = tok.decode([i])
        assert not any(ch in piece for ch in CJK_AND_EMOJI), (i, piece)
    for ch in CJK_AND_EMOJI:
        assert len([t for t in encode(tok, ch) if tok.decode([t]).strip()]) >= 2, ch  # "▁" aside


# ---- incremental decoding ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip", [True, False])
def test_random_tokens_stream_to_decode(tok, seed, skip):
    rng = random.Random(seed)
    prompts = ([], [BOS_ID], tok.encode("Hello"), tok.encode("\u4f60\u597d world"))
    for trial in range(40):
        output = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 50))]
        prompt = prompts[trial % len(prompts)]
        out, deltas, _ = stream(tok, prompt, output, skip_special_tokens=skip)
        want = expected_text(tok, prompt, output, skip)
        assert "".join(deltas) == want == out.text, (prompt, output)
        if REPLACEMENT_CHAR not in want:
            assert not any(REPLACEMENT_CHAR in d for d in deltas)
        if not prompt or prompt == [BOS_ID] and skip:  # no visible context: exactly decode(output)
            assert out.text == tok.decode(output, skip_special_tokens=skip)


@pytest.mark.parametrize("text", MULTILINGUAL)
def test_multilingual_text_streams_whole_characters(tok, text):
    output = encode(tok, text)
    out, deltas, _ = stream(tok, tok.encode("Say:"), output)
    assert "".join(deltas) == expected_text(tok, tok.encode("Say:"), output) == out.text
    assert out.text.strip() == text.strip()
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    if not text.isascii():
        # A character spanning tokens was held back for at least one step, then came out whole.
        assert "" in deltas[:-1]


def test_held_character_comes_out_with_its_last_byte(toks):
    tok = toks["byte_bpe"]
    output = encode(tok, "a\U0001f600b")
    out = OutputText(tok, [])
    seen = []
    for token in output:
        out.append(token)
        seen.append(out.take_new())
    emoji_tokens = len(output) - 2
    assert emoji_tokens >= 2
    assert seen == ["a"] + [""] * (emoji_tokens - 1) + ["\U0001f600", "b"]


def test_metaspace_output_keeps_its_first_space(tok):
    prompt = tok.encode("Hello")
    output = encode(tok, " world")
    out, deltas, _ = stream(tok, prompt, output)
    assert out.text == "".join(deltas) == " world"
    assert deltas[0].startswith(" ")
    if tok.decode(output) == "world":  # Metaspace: decoded alone, the space is gone; the stream keeps it
        assert tok.convert_ids_to_tokens(output[0]).startswith("\u2581")


def test_output_decoded_alone_without_prompt(tok):
    output = encode(tok, " world")
    out, _, _ = stream(tok, [], output)
    assert out.text == tok.decode(output)


def test_prompt_ending_inside_a_character(tok):
    ids = encode(tok, "Hi \u4f60\u597d!")
    cut = next(i for i in range(1, len(ids)) if REPLACEMENT_CHAR in tok.decode(ids[:i]))  # inside 你
    prompt, output = [BOS_ID] + ids[:cut], ids[cut:]
    out, deltas, _ = stream(tok, prompt, output)
    assert out.text == "".join(deltas) == tok.decode(output)


def test_output_continuing_a_prompt_byte_run(tok):
    # Llama 2 spells 你 in byte tokens; a stray continuation byte right after it would turn that whole run
    # into U+FFFD when decoded together. The prompt's text is not the output's to change.
    prompt = tok.encode("Q: \u4f60")
    output = [tok.convert_tokens_to_ids("<0x80>") if byte_token_ids(tok) else encode(tok, "\u4f60")[-1]]
    output += encode(tok, " ok")
    out, deltas, _ = stream(tok, prompt, output)
    assert out.text == "".join(deltas) == tok.decode(output)
    assert out.text.startswith(REPLACEMENT_CHAR) and out.text.endswith("ok")


def test_special_tokens_skipped_or_kept(tok):
    body = encode(tok, "Hi \u4f60 there")
    mid = next(i for i in range(1, len(body)) if REPLACEMENT_CHAR in tok.decode(body[:i]))  # inside 你
    output = [BOS_ID] + body[:mid] + [EOS_ID] + body[mid:] + [EOS_ID]
    out, deltas, _ = stream(tok, tok.encode("Q:"), output, skip_special_tokens=True)
    assert "<s>" not in out.text and "</s>" not in out.text
    assert out.text.strip() == "Hi \u4f60 there"
    assert "".join(deltas) == expected_text(tok, tok.encode("Q:"), output, skip=True)
    out, deltas, _ = stream(tok, tok.encode("Q:"), output, skip_special_tokens=False)
    assert out.text.endswith("</s>") and out.text.count("<s>") == 1
    assert "".join(deltas) == expected_text(tok, tok.encode("Q:"), output, skip=False)


def test_long_byte_run_still_streams(toks):
    # Llama 2 spells rare characters in byte tokens; a long run is emitted character by character once it
    # has been held MAX_HELD_TOKENS tokens, instead of waiting for the run to end.
    tok = toks["metaspace_bytefallback"]
    text = "\u4e2d" * 40
    output = encode(tok, text)
    assert sum(tok.convert_ids_to_tokens(t).startswith("<0x") for t in output) == 120
    out, deltas, _ = stream(tok, tok.encode("Q:"), output)
    assert "".join(deltas) == expected_text(tok, tok.encode("Q:"), output) == out.text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    first = next(i for i, d in enumerate(deltas) if "\u4e2d" in d)
    assert first <= MAX_HELD_TOKENS + 3 < len(output) - 1


def test_slow_tokenizer(slow_tok):
    rng = random.Random(0)
    for text in MULTILINGUAL:
        output = slow_tok.encode(text, add_special_tokens=False)
        out, deltas, _ = stream(slow_tok, slow_tok.encode("Q:"), output)
        assert "".join(deltas) == out.text == text
    for _ in range(50):
        output = [rng.randrange(len(slow_tok)) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            out, deltas, _ = stream(slow_tok, [], output, skip_special_tokens=skip)
            assert "".join(deltas) == slow_tok.decode(output, skip_special_tokens=skip), output


class CountingTokenizer:
    """Forwards the public calls OutputText makes and records the length of every decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, []
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, ids, **kwargs):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)

    def convert_ids_to_tokens(self, ids):
        return self.tokenizer.convert_ids_to_tokens(ids)


def test_cost_per_token_is_a_short_window(tok):
    counting = CountingTokenizer(tok)
    output = encode(tok, " ".join(MULTILINGUAL) * 20)
    assert len(output) > 1000
    out = OutputText(counting, tok.encode("Q:"))
    counting.decoded.clear()
    for token in output:
        out.append(token)
        out.take_new()
    out.take_new(final=True)
    assert out.text == expected_text(tok, tok.encode("Q:"), output)
    assert len(counting.decoded) <= 2 * len(output) + 2
    # prefix..read spans at most one emission (≤ 2·MAX_HELD_TOKENS + 1), and so does read..end.
    assert max(counting.decoded) <= 4 * MAX_HELD_TOKENS + 2


# ---- stop strings -----------------------------------------------------------------------------------------
def first_complete_index(tok, output: list[int], stop: str) -> int:
    """The token at which `stop` is in the decoded text, plus the tokens a byte-fallback run is held."""
    k = next(i for i in range(len(output)) if stop in tok.decode(output[:i + 1]))
    while k < len(output) and tok.convert_ids_to_tokens(output[k]).startswith("<0x"):
        k += 1  # the run is emitted with the next non-byte token
    return k


def test_stop_spanning_tokens(tok):
    output = encode(tok, "Hello world. Stop here. more text")
    stop = "Stop here"
    assert not any(stop in tok.decode([t]) for t in output)  # it spans several tokens
    out, deltas, stopped_at = stream(tok, [], output, stop=[stop])
    assert out.text == "Hello world. " == "".join(deltas)
    assert stopped_at == (first_complete_index(tok, output, stop), stop)
    assert out.matched_stop == stop
    with pytest.raises(RuntimeError, match="stop string"):
        out.append(output[-1])


def test_stop_inside_a_token_cuts_the_rest_of_it(tok):
    text = "Hello world. Stop here."
    output = encode(tok, text)
    # A stop string that starts and ends inside multi-character tokens ("el|lo| w|or" → "llo wo").
    pieces = [tok.decode(output[:i + 1]) for i in range(len(output))]
    k = next(i for i in range(1, len(output)) if len(pieces[i]) - len(pieces[i - 1]) >= 2 and pieces[i - 1]
             and len(pieces[i - 1]) >= 2)
    stop = pieces[k - 1][-1] + pieces[k][len(pieces[k - 1]):-1]  # last char before token k, then all of k but one
    assert stop and not any(stop in tok.decode([t]) for t in output)
    start = text.index(stop)
    out, deltas, stopped_at = stream(tok, [], output, stop=[stop])
    assert out.text == text[:start] == "".join(deltas)
    assert stopped_at[1] == stop


def test_earliest_stop_wins(tok):
    text = "Hello world, again"
    output = encode(tok, text)
    # Two stop strings completed by the same token: the one that starts earlier wins, whatever the order.
    pieces = [tok.decode(output[:i + 1]) for i in range(len(output))]
    k = next(i for i in range(1, len(output)) if len(pieces[i]) - len(pieces[i - 1]) >= 2)
    new = pieces[k][len(pieces[k - 1]):]
    first, last = pieces[k - 1][-1] + new[0], new[-1]  # starts before `last`, ends with or before it
    assert first not in pieces[k - 1] and last not in pieces[k - 1]
    out, _, stopped_at = stream(tok, [], output, stop=[last, first])
    assert stopped_at == (k, first)
    assert out.text == text[:text.index(first)]
    out, _, stopped_at = stream(tok, [], output, stop=["again", "world"])
    assert out.text == "Hello " and stopped_at[1] == "world"


def test_stop_at_the_very_start(tok):
    output = encode(tok, "Hello world")
    for prompt in ([], [BOS_ID]):
        out, deltas, stopped_at = stream(tok, prompt, output, stop=["Hel"])
        assert out.text == "" and deltas == [""] * len(deltas)
        assert stopped_at == (first_complete_index(tok, output, "Hel"), "Hel")
    out, deltas, stopped_at = stream(tok, [], output, stop=["H"])
    assert out.text == "" and stopped_at == (first_complete_index(tok, output, "H"), "H")


def test_streaming_holds_a_possible_stop_and_releases_it(tok):
    text = "Hello world, world! Bye"
    output = encode(tok, text)
    stop = "world!"
    out = OutputText(tok, [], [stop])
    streamed, history = "", []
    for token in output:
        matched = out.append(token)
        streamed += out.take_new()
        history.append((out.text, streamed))
        # What was streamed is final: nothing of the "world!" that completes later leaks.
        assert "Hello world, ".startswith(streamed), streamed
        if matched:
            break
    streamed += out.take_new(final=True)
    assert streamed == out.text == "Hello world, "
    assert out.matched_stop == stop
    # The first "world" was held while it could still become "world!", then released by the comma.
    assert ("Hello world", "Hello ") in history
    assert any(text.startswith("Hello world, w") and sent == "Hello world, " for text, sent in history)


def test_final_releases_an_unfinished_stop_prefix(tok):
    output = encode(tok, "Hello wor")
    out, deltas, stopped_at = stream(tok, [], output, stop=["world"])
    assert stopped_at is None and out.matched_stop is None
    assert "".join(deltas[:-1]) == "Hello "
    assert deltas[-1] == "wor" and out.text == "Hello wor"
    with pytest.raises(RuntimeError, match="finished"):
        out.append(output[0])


def test_stop_in_the_last_held_characters(tok):
    # The output ends in a character the decoder still holds (a byte-fallback run, or nothing held);
    # the final flush still cuts at a stop string inside it.
    output = encode(tok, "ok \u597d")
    out, deltas, stopped_at = stream(tok, [], output, stop=["\u597d"])
    assert out.text == "ok " == "".join(deltas)
    assert out.matched_stop == "\u597d"


def test_stop_validation(tok):
    with pytest.raises(TypeError, match="one string"):
        OutputText(tok, [], "stop")
    with pytest.raises(ValueError, match="non-empty"):
        OutputText(tok, [], ["ok", ""])
    out = OutputText(tok, [])
    with pytest.raises(ValueError, match="non-negative"):
        out.append(-1)
    with pytest.raises(TypeError):
        out.append(1.5)


# ---- load_tokenizer ---------------------------------------------------------------------------------------
def test_load_tokenizer_errors_name_the_folder(tmp_path, folders):
    assert len(load_tokenizer(folders["byte_bpe"])) == len(load_tokenizer(str(folders["byte_bpe"])))
    missing = tmp_path / "missing"
    with pytest.raises(ValueError, match="not a folder") as e:
        load_tokenizer(missing)
    assert str(missing) in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer files") as e:
        load_tokenizer(empty)
    assert str(empty) in str(e.value)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with pytest.raises(ValueError, match="could not load the tokenizer") as e:
        load_tokenizer(broken)
    assert str(broken) in str(e.value) and e.value.__cause__ is not None

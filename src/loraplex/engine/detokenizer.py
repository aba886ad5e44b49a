"""Token ids → text, one sampled token at a time, cut at stop strings.

Decoding a token alone is wrong in two ways: byte-level tokens may hold part of a UTF-8 character, and
Metaspace decoders (Llama 2) strip the first space of whatever they decode. So each step decodes a short
window twice, with a few tokens of left context, and emits the difference (vLLM's "prefix offset / read
offset" technique):

    new_text    = decode(ids[prefix:])          # the window with the new token
    prefix_text = decode(ids[prefix:read])      # the same window without the tokens not yet emitted
    emit new_text[len(prefix_text):] once it is complete, then prefix, read = read, len(ids)

"Complete" means the window does not end in U+FFFD (a character still being assembled) and, for
byte-fallback tokenizers, the last token is not a `<0xNN>` byte token: such a tokenizer decodes a whole
run of byte tokens at once and turns all of it into U+FFFD if any byte is invalid, so a run is only final
once a non-byte token ends it. Holding is capped (MAX_HELD_TOKENS) so a step never decodes more than a
few dozen tokens.

Skipped special tokens (eos, bos) are never put in the window: `decode(skip_special_tokens=True)` drops
them before its decoder runs, and a window of nothing but skipped tokens would decode to "" and let a
Metaspace decoder strip a space that belongs to the next token.

Text is streamed without `clean_up_tokenization_spaces` (a rewrite of the whole text, " ." → ".", that
cannot be streamed; BPE tokenizers have it off).
"""
from __future__ import annotations

import operator
import re
from pathlib import Path
from typing import Any, Sequence

REPLACEMENT_CHAR = "\ufffd"  # what decoders return for bytes that are not (yet) valid UTF-8
CONTEXT_TOKENS = 5           # prompt tokens decoded with the output, so its first token keeps its space
MAX_HELD_TOKENS = 16         # past this many unemitted tokens, stop waiting for a byte run to end;
                             # past twice this many, emit even a window that ends in U+FFFD
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "vocab.txt", "spiece.model", "tekken.json")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def load_tokenizer(folder: str | Path) -> Any:
    """`transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)`.

    Raises ValueError naming the folder when it holds no tokenizer files or they fail to load.
    """
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder (expected a tokenizer folder with one of {', '.join(TOKENIZER_FILES)})")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{path}: no tokenizer files (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer
    except ImportError as e:
        raise ValueError(f"{path}: loading a tokenizer needs transformers, a dependency of loraplex that this "
                         f"environment lacks (reinstall loraplex, or pip install transformers jinja2): {e}") from e
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many types here (OSError, ValueError, JSON and tokenizers errors)
        raise ValueError(f"{path}: could not load the tokenizer: {type(e).__name__}: {e}") from e


class OutputText:
    """Incremental detokenization of one request's output, with stop strings."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True) -> None:
        if isinstance(stop, str):
            raise TypeError(f"stop must be a sequence of strings, not one string ({stop!r}); wrap it in a list")
        stops = tuple(stop)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self._tokenizer = tokenizer
        self._skip_special = bool(skip_special_tokens)
        self._special_ids = frozenset(tokenizer.all_special_ids) if self._skip_special else frozenset()
        self._invisible: dict[int, bool] = {}
        self._stops = stops
        self._max_stop_len = max((len(s) for s in stops), default=0)

        # The window: a few prompt tokens of context, then the output. Offsets index into it.
        keep = CONTEXT_TOKENS + MAX_HELD_TOKENS + 1  # the context, and a trailing byte run to drop before it
        self._ids = self._context([operator.index(t) for t in prompt_token_ids[-keep:]])
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: the output cannot be told apart from it, so decode it alone.
            self._ids, self._prefix_text = [], ""
        self._prefix, self._read = 0, len(self._ids)

        self._text = ""            # complete characters, cut before a matched stop string
        self._returned = 0         # len of text already given out by take_new
        self._stop: str | None = None
        self._final = False

    # ---- public API --------------------------------------------------------------------------------
    def append(self, token_id: int) -> str | None:
        """Add one sampled token. Returns the stop string that now occurs in the output text (the text is cut
        just before its first occurrence and stays cut; further appends are an error), else None."""
        if self._stop is not None:
            raise RuntimeError(f"the output already ended at stop string {self._stop!r}")
        if self._final:
            raise RuntimeError("the output is finished: take_new(final=True) was called")
        token_id = operator.index(token_id)
        if token_id < 0:
            raise ValueError(f"token ids are non-negative, got {token_id}")
        if self._is_invisible(token_id):
            return None
        self._ids.append(token_id)
        delta = self._step(final=False)
        return self._extend(delta) if delta else None

    @property
    def text(self) -> str:
        """The output text so far: complete characters only, cut before a matched stop string."""
        return self._text

    @property
    def matched_stop(self) -> str | None:
        """The stop string the text was cut at, or None."""
        return self._stop

    def take_new(self, final: bool = False) -> str:
        """The part of `text` not returned by earlier calls.

        While not final, holds back the longest suffix of `text` that is a proper prefix of some stop string,
        so streamed deltas never contain any part of a stop string. final=True returns everything left,
        including what the tokenizer decodes a trailing incomplete UTF-8 sequence to (e.g. U+FFFD); a stop
        string completed by that last part still cuts the text (see `matched_stop`). No appends after it.
        """
        if final and not self._final:
            self._final = True
            if self._stop is None:
                delta = self._step(final=True)
                if delta:
                    self._extend(delta)
        end = len(self._text)
        if not self._final and self._stop is None:
            end -= self._partial_stop_len()
        new = self._text[self._returned:end]
        self._returned = max(self._returned, end)
        return new

    # ---- decoding ----------------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False)

    def _is_invisible(self, token_id: int) -> bool:
        """A special token that decode drops (only when skipping them)."""
        if token_id not in self._special_ids:
            return False
        if token_id not in self._invisible:
            self._invisible[token_id] = self._decode([token_id]) == ""
        return self._invisible[token_id]

    def _is_byte_token(self, token_id: int) -> bool:
        token = self._tokenizer.convert_ids_to_tokens(token_id)
        return isinstance(token, str) and _BYTE_TOKEN.fullmatch(token) is not None

    def _context(self, prompt: list[int]) -> list[int]:
        # Drop a trailing byte-token run (and skipped specials): the output may continue that run, and
        # the prompt's part of it could not be told apart from the output's.
        end = len(prompt)
        while end > 0 and (self._is_invisible(prompt[end - 1]) or self._is_byte_token(prompt[end - 1])):
            end -= 1
            if len(prompt) - end > MAX_HELD_TOKENS:
                return []
        return prompt[max(0, end - CONTEXT_TOKENS):end]

    def _step(self, final: bool) -> str:
        """Text of the tokens after `read` once it is complete (or `final`); advances the offsets."""
        if self._read == len(self._ids):
            return ""
        new_text = self._decode(self._ids[self._prefix:])
        if not final:
            held = len(self._ids) - self._read
            if held <= MAX_HELD_TOKENS and self._is_byte_token(self._ids[-1]):
                return ""  # a byte run may still turn invalid
            consistent = new_text.startswith(self._prefix_text)
            complete = consistent and not new_text.endswith(REPLACEMENT_CHAR)
            if held <= 2 * MAX_HELD_TOKENS and (not complete or len(new_text) == len(self._prefix_text)):
                # Incomplete character, or nothing visible yet: advancing over a window that decodes to ""
                # would let a Metaspace decoder strip the next token's space.
                return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix:self._read])
        return delta

    # ---- stop strings ------------------------------------------------------------------------------
    def _extend(self, delta: str) -> str | None:
        old_len = len(self._text)
        self._text += delta
        if not self._stops:
            return None
        # The text before had no match, so a new one ends in delta and starts at most max_len - 1 before it.
        start = max(0, old_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self._text, self._stop = self._text[:best[0]], best[1]
        return best[1]

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the unreturned text that some stop string starts with."""
        longest = min(self._max_stop_len - 1, len(self._text) - self._returned)
        for k in range(longest, 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

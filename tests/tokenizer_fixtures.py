"""Tiny real tokenizers, trained offline with `tokenizers` and saved with `save_pretrained`, so tests load
exactly the files users bring (`AutoTokenizer.from_pretrained(folder)`).

Two kinds cover the two ways served models turn bytes into text:
- "byte_bpe": byte-level BPE (GPT-2, Llama 3). Every byte is a vocab symbol, so any text round-trips and a
  CJK character or emoji is several tokens whose prefix is not valid UTF-8.
- "metaspace_bytefallback": Llama 2's layout. Spaces become "▁", characters outside the small trained
  alphabet become `<0xNN>` byte tokens, and the decoder strips the one space the pre-tokenizer prepended.
Both put `<unk>`=0, `<s>`=1, `</s>`=2 first and prepend `<s>` when encoding, as Llama does.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

KINDS = ("byte_bpe", "metaspace_bytefallback")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))
METASPACE = "\u2581"

ENGLISH_WEIGHT = 4
CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "A model serves many adapters: one base, hundreds of fine-tunes.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9, 42, 3.14159, 2024-06-01, 100%.",
    "Punctuation (brackets) [square] {curly} <angle> \"quotes\" 'single' - dash; semi: colon... ?!",
    "the the the and and of of to to in in is is it it that that with with for for on on",
    "Stop here. STOP! end of text; the end.",
    "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e, na\u00efve fa\u00e7ade, \u00fcber Stra\u00dfe, "
    "ma\u00f1ana, S\u00e3o Paulo, \u00c5ngstr\u00f6m.",
    "\u4f60\u597d\uff0c\u4e16\u754c\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\u3002",  # Chinese
    "\u3053\u3093\u306b\u3061\u306f\u3001\u4e16\u754c\u3002\u30c6\u30b9\u30c8\u3067\u3059\u3002",  # Japanese
    "\ud55c\uad6d\uc5b4 \ubb38\uc7a5\uc785\ub2c8\ub2e4.",  # Korean
    "Emoji: \U0001f600 \U0001f680 \U0001f44d\U0001f3fd \u2764\ufe0f \U0001f1eb\U0001f1f7 done.",
    "Tabs\tand\nnew lines\n\nand  double  spaces.",
)


def make_tokenizer(folder: Path, kind: str = "byte_bpe", vocab_size: int = 320) -> Path:
    """Train a tokenizer of `kind` with at most `vocab_size` tokens and save it to `folder`; returns `folder`.

    Deterministic: the same arguments write the same files.
    """
    from transformers import PreTrainedTokenizerFast

    if kind == "byte_bpe":
        tok = _byte_bpe(vocab_size)
    elif kind == "metaspace_bytefallback":
        tok = _metaspace_bytefallback(vocab_size)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {KINDS}")
    _add_bos_post_processor(tok)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        # Clean-up rewrites " ." into "."; real BPE tokenizers switch it off, and it cannot be streamed.
        clean_up_tokenization_spaces=False)
    if len(fast) > vocab_size:
        raise RuntimeError(f"{kind}: trained {len(fast)} tokens, more than vocab_size={vocab_size}")
    folder = Path(folder)
    fast.save_pretrained(folder)
    return folder


def _byte_bpe(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"byte_bpe needs vocab_size >= {len(SPECIAL_TOKENS) + 256} (specials + 256 bytes), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        # All 256 byte symbols, seen in the corpus or not, so that any text can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_training_text(), trainer=trainer)
    return tok


def _metaspace_bytefallback(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    budget = vocab_size - len(SPECIAL_TOKENS) - len(BYTE_TOKENS)  # room for characters and merges
    if budget < 1:
        raise ValueError(f"metaspace_bytefallback needs vocab_size > {len(SPECIAL_TOKENS) + len(BYTE_TOKENS)} "
                         f"(specials + 256 byte tokens), got {vocab_size}")
    pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always")

    # Half the budget for single characters, the most frequent first (ties by code point, so the choice is
    # deterministic); every other character is spelled in byte tokens, as rare characters are in Llama 2.
    counts = Counter(ch for line in _training_text() for ch in METASPACE + line.replace(" ", METASPACE))
    alphabet = [ch for ch, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:max(1, budget // 2)]]
    trainer = trainers.BpeTrainer(vocab_size=budget, show_progress=False, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet))
    scratch = Tokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizer
    scratch.train_from_iterator(_training_text(), trainer=trainer)
    trained = json.loads(scratch.to_str())["model"]

    # Llama 2's id layout: specials, then the 256 byte tokens, then characters and merges.
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + BYTE_TOKENS)}
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.pre_tokenizer = pre_tokenizer
    # Undo the pre-tokenizer: "▁" back to " ", byte tokens back to UTF-8, then drop the prepended space.
    tok.decoder = decoders.Sequence([decoders.Replace(METASPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _training_text() -> list[str]:
    # English weighs more, so that its pairs win every merge and CJK / emoji stay split over several tokens.
    return [line for line in CORPUS for _ in range(ENGLISH_WEIGHT if line.isascii() else 1)]


def _add_bos_post_processor(tok) -> None:
    from tokenizers import processors
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])

"""Tokenizers trained locally with `tokenizers`, one family per recipe, cached under the output directory.

Nothing comes from the Hub: GPT gets byte-level BPE (as GPT-2), BERT lower-cased WordPiece (as BERT), T5 a
Unigram model with Metaspace pre-tokenization (SentencePiece's algorithm, as T5) plus the ``<extra_id_N>``
sentinels span corruption needs. Each is wrapped as a transformers fast tokenizer so it saves with the final
model and loads with ``AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

KINDS = ("bpe", "wordpiece", "unigram")
_SETTINGS_FILE = "trained_with.json"


def sentinel_token(i: int) -> str:
    return f"<extra_id_{i}>"


def _train_bpe(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    eos = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=eos, eos_token=eos, unk_token=eos, pad_token=eos
    )


def _train_wordpiece(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _word_forms_document(texts: Sequence[str], n_words: int) -> str:
    """One extra training document: the ``n_words`` most frequent words, each followed by a comma.

    The `tokenizers` Unigram trainer seeds its candidate pieces only from substrings found in at least two
    *distinct* pre-tokenized words. A word that only ever appears as itself (common in a small corpus: the
    synthetic one always writes "three" between spaces) never becomes a piece and is spelled out in
    characters. Giving every frequent word a second form ("three,") makes the whole word a seed; its score
    still comes from the real counts."""
    counts = Counter(word for text in texts for word in text.split())
    return " ".join(f"{word}," for word, _ in counts.most_common(n_words))


def _train_unigram(texts: Sequence[str], vocab_size: int, num_sentinels: int) -> PreTrainedTokenizerFast:
    # T5's layout: pad=0, eos=1, unk=2, the learnt pieces, then the sentinels with <extra_id_0> last.
    specials = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(
        vocab_size=max(len(specials) + 1, vocab_size - num_sentinels),
        special_tokens=specials,
        unk_token="<unk>",
        show_progress=False,
    )
    tok.train_from_iterator([*texts, _word_forms_document(texts, vocab_size)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))]
    )
    sentinels = [sentinel_token(i) for i in reversed(range(num_sentinels))]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    wrapped.add_special_tokens({"additional_special_tokens": sentinels})
    return wrapped


def train_tokenizer(
    kind: str, texts: Sequence[str], vocab_size: int, num_sentinels: int = 0
) -> PreTrainedTokenizerFast:
    """A fresh tokenizer of ``kind`` ("bpe", "wordpiece" or "unigram") trained on ``texts``.

    ``vocab_size`` is an upper bound: a small corpus yields fewer tokens. ``num_sentinels`` (unigram only)
    adds ``<extra_id_0>`` .. ``<extra_id_{n-1}>`` within that bound."""
    if kind == "bpe":
        return _train_bpe(texts, vocab_size)
    if kind == "wordpiece":
        return _train_wordpiece(texts, vocab_size)
    if kind == "unigram":
        return _train_unigram(texts, vocab_size, num_sentinels)
    raise ValueError(f"unknown tokenizer kind {kind!r}; expected one of {KINDS}")


def load_or_train_tokenizer(
    kind: str,
    texts: list[str],
    cache_dir: Path,
    vocab_size: int,
    num_sentinels: int = 0,
    path: str | None = None,
    source: str = "",
) -> PreTrainedTokenizerBase:
    """``path`` if given (any saved transformers tokenizer); else the tokenizer cached in ``cache_dir``; else
    train one on ``texts`` and cache it there. Call under ``accelerator.main_process_first()`` so one process
    trains and the others load its result.

    The cache records what it was trained from (``kind``, sizes, and ``source``, a description of the text);
    reusing an output directory with other settings is refused rather than silently retraining, because the
    checkpoints there were made with the cached tokenizer's ids."""
    if path:
        return AutoTokenizer.from_pretrained(path)
    settings = {"kind": kind, "vocab_size": vocab_size, "num_sentinels": num_sentinels, "source": source}
    record = cache_dir / _SETTINGS_FILE
    if (cache_dir / "tokenizer.json").is_file():
        cached = json.loads(record.read_text()) if record.is_file() else None
        if cached != settings:
            raise SystemExit(
                f"the tokenizer cached in {cache_dir} was trained with {cached}, this run asks for {settings}; "
                "use another --output_dir, delete that tokenizer folder, or pass --tokenizer to reuse it as is"
            )
        logger.info("loading the cached tokenizer from %s", cache_dir)
        return AutoTokenizer.from_pretrained(str(cache_dir))
    logger.info("training a %s tokenizer (vocab <= %d) on %d documents", kind, vocab_size, len(texts))
    tokenizer = train_tokenizer(kind, texts, vocab_size, num_sentinels)
    tokenizer.save_pretrained(str(cache_dir))
    record.write_text(json.dumps(settings))
    return tokenizer


def sentinel_ids(tokenizer: PreTrainedTokenizerBase, needed: int) -> list[int]:
    """Ids of ``<extra_id_0>`` .. ``<extra_id_{needed-1}>``, checked to exist in ``tokenizer``."""
    ids = []
    for i in range(needed):
        token_id = tokenizer.convert_tokens_to_ids(sentinel_token(i))
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(
                f"the tokenizer has no {sentinel_token(i)!r} token, but span corruption at this --seq_len needs "
                f"{needed} sentinels; use a tokenizer with <extra_id_0>..<extra_id_{needed - 1}> or a shorter "
                "--seq_len"
            )
        ids.append(token_id)
    return ids


def padded_vocab_size(tokenizer: PreTrainedTokenizerBase, multiple: int = 64) -> int:
    """The tokenizer's size rounded up to ``multiple``, so tensor parallelism can split the embedding rows
    evenly (and GPUs get aligned matmuls)."""
    return -(-len(tokenizer) // multiple) * multiple

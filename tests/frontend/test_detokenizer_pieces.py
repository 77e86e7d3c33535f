"""The detokenizer's piece table: tokens whose text does not depend on their neighbours
are looked up instead of decoded through ``DecodeStream``. The text must be the general
path's, byte for byte, for every tokenizer kind the tests build (byte-level BPE,
SentencePiece with byte fallback under both of its decoders, the demo model's), over
random token sequences with special tokens, byte pieces, emoji and multi-byte characters;
and the table must actually serve most tokens of ordinary text."""

from __future__ import annotations

import json
import random
import threading
from typing import Any, Literal

import pytest
from tokenizers.decoders import DecodeStream

from enginecore.checkpoints import make_demo_checkpoint, make_tokenizer
from enginecore.engine import detokenizer as detokenizer_module
from enginecore.engine import piece_table as piece_table_module
from enginecore.engine.detokenizer import IncrementalDetokenizer
from enginecore.engine.output import OutputProcessor
from enginecore.engine.piece_table import build_piece_table, piece_table
from enginecore.params import SamplingParams

# Text the SentencePiece trainer sees besides English words: multi-byte scripts and emoji,
# so that some of them get tokens of their own and the rest fall back to bytes.
MULTILINGUAL = (
    "Grüße aus Köln, naïve café, señor. Привет, как дела? 日本語のテキストです。"
    "中文文本测试。 한국어 문장. 🙂 🚀 👩‍💻 🇫🇷 ∑ x² ≤ ∞ — “quoted” … €10\n"
)


def _training_text(limit: int = 400_000) -> str:
    # The byte-level test tokenizer's vocabulary: varied, local, no download.
    vocab = json.loads(make_tokenizer(8192).backend_tokenizer.to_str())["model"]["vocab"]
    words = " ".join(token.replace("Ġ", " ").replace("Ċ", "\n") for token in vocab)
    text = (MULTILINGUAL * 50) + words
    return text[:limit]


# --- SentencePiece-style tokenizers (as Llama's and Mistral's tokenizer.json: a BPE whose
# unknown characters fall back to <0xNN> byte tokens, ▁ for spaces) ---------------------


def make_sentencepiece_tokenizer(
    decoder: Literal["llama", "metaspace"] = "llama", vocab_size: int = 2000
) -> Any:
    """A ``PreTrainedTokenizerFast`` with byte fallback and the given decoder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 256,
        special_tokens=specials,
        limit_alphabet=200,
        show_progress=False,
    )
    trained.train_from_iterator(_training_text().splitlines(), trainer)
    model = json.loads(trained.to_str())["model"]
    # As Llama's: the 256 byte pieces are ordinary vocabulary right after the specials.
    pieces = [*specials, *(f"<0x{i:02X}>" for i in range(256))]
    pieces += [
        t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1]) if t not in specials
    ]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(
            {t: i for i, t in enumerate(pieces)},
            merges,
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.add_special_tokens(specials)
    if decoder == "llama":
        tok.normalizer = normalizers.Sequence(
            [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
        )
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="first")]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def demo_tokenizer() -> Any:
    """The demo model's tokenizer (SmolLM2's byte-level BPE), from its converted checkpoint."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_demo_checkpoint())


# Characters the test tokenizers have no token for (byte fallback, split UTF-8 sequences).
RARE = "🦀 ẞ \U0001d518\U0001d52b ꙮ ﷽ 🧑🏽\u200d🚀 "
TEXT = MULTILINGUAL + RARE + "def main(argv):\n    return {'x': [1, 2]}  # done\n"
SEQUENCES = 60


@pytest.fixture(scope="module", params=["byte_level", "sp_llama", "sp_metaspace", "demo"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    kind = request.param
    if kind == "byte_level":
        return make_tokenizer(1024)
    if kind == "demo":
        return demo_tokenizer()
    return make_sentencepiece_tokenizer("llama" if kind == "sp_llama" else "metaspace")


def _sequences(tokenizer: Any, seed: int) -> list[list[int]]:
    """Random ids over the whole vocabulary, encoded text with emoji and multi-byte
    characters, and the two mixed (so byte pieces are cut at random places)."""
    rng = random.Random(seed)
    vocab = len(tokenizer)
    special = list(tokenizer.all_special_ids)
    text_ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    out = []
    for index in range(SEQUENCES):
        length = rng.randrange(1, 80)
        if index % 3 == 0:
            seq = [rng.randrange(vocab) for _ in range(length)]
        elif index % 3 == 1:
            start = rng.randrange(len(text_ids))
            seq = text_ids[start : start + length]
        else:
            seq = []
            while len(seq) < length:
                roll = rng.random()
                if roll < 0.1:
                    seq.append(rng.choice(special))
                elif roll < 0.3:
                    seq.append(rng.randrange(vocab))
                else:
                    start = rng.randrange(len(text_ids))
                    seq += text_ids[start : start + rng.randrange(1, 6)]
        out.append(seq)
    return out


def _stream_text(tokenizer: Any, ids: list[int], skip: bool) -> str:
    """The general path: one ``DecodeStream.step`` per token."""
    stream = DecodeStream(skip_special_tokens=skip)
    return "".join(stream.step(tokenizer.backend_tokenizer, i) or "" for i in ids)


def _detokenizer_text(tokenizer: Any, ids: list[int], skip: bool, seed: int) -> str:
    """The detokenizer fed as the output processor feeds it: the first token through
    ``update``, then plain steps through ``add_token``, now and then several at once."""
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
    detok.update(ids[:1])
    pos = 1
    while pos < len(ids):
        if rng.random() < 0.2:
            take = rng.randrange(1, 4)
            detok.update(ids[pos : pos + take])
            pos += take
        else:
            detok.add_token(ids[pos])
            pos += 1
    return detok.text


@pytest.mark.parametrize("skip", [True, False])
def test_text_is_the_decode_streams_byte_for_byte(tokenizer: Any, skip: bool) -> None:
    assert piece_table(tokenizer), "no piece table for this tokenizer"
    compared = 0
    for seed, ids in enumerate(_sequences(tokenizer, seed=int(skip))):
        try:
            expected = _stream_text(tokenizer, ids, skip)
        except Exception:  # DecodeStream's "invalid prefix" on some runs of byte pieces
            continue
        got = _detokenizer_text(tokenizer, ids, skip, seed)
        assert got.encode() == expected.encode(), (ids, got, expected)
        compared += 1
    assert compared >= SEQUENCES * 3 // 4


def test_text_of_plain_text_is_the_tokenizers_decode(tokenizer: Any) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    got = _detokenizer_text(tokenizer, ids, True, seed=0)
    assert got == tokenizer.decode(ids, skip_special_tokens=True)
    assert any(ord(c) > 0xFFFF for c in got) and "🦀" in got


class _CountingStream:
    """A DecodeStream that counts its steps."""

    steps = 0

    def __init__(self, skip_special_tokens: bool) -> None:
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, backend: Any, token_id: int) -> str | None:
        _CountingStream.steps += 1
        return self._stream.step(backend, token_id)


def test_the_table_serves_most_tokens_of_text(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = piece_table(tokenizer)
    assert len(table) > len(tokenizer) // 2
    monkeypatch.setattr(detokenizer_module, "_decode_stream", _CountingStream)
    _CountingStream.steps = 0
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    for token_id in ids:
        detok.add_token(token_id)
    assert detok.text == _stream_text(tokenizer, ids, True)
    assert _CountingStream.steps <= 2, f"{_CountingStream.steps} of {len(ids)} tokens decoded"


def test_no_table_for_a_decoder_that_joins_tokens() -> None:
    """A WordPiece decoder (``##`` pieces join the previous word) is not context-free."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "play": 1, "##ing": 2, "run": 3}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    assert build_piece_table(fast) == {}
    detok = IncrementalDetokenizer(fast, SamplingParams())
    for token_id in (1, 2, 3, 1, 2):
        detok.add_token(token_id)
    assert detok.text == _stream_text(fast, [1, 2, 3, 1, 2], True)


def test_start_up_does_not_wait_for_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The output processor starts the table's build and returns; a request decoded
    before the table lands goes through the stream, with the same text."""
    tokenizer = make_tokenizer(8192)  # a fresh object: no table built for it yet
    gate = threading.Event()
    build = piece_table_module.build_piece_table

    def gated_build(tok: Any) -> dict[int, str]:
        assert gate.wait(10), "the table's build held up start-up"
        return build(tok)

    monkeypatch.setattr(piece_table_module, "build_piece_table", gated_build)
    OutputProcessor(tokenizer)
    assert not gate.is_set()
    assert piece_table(tokenizer, wait_for_background=False) == {}
    ids = tokenizer.encode("Streams decode while the table is built. " * 4)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    for token_id in ids:
        detok.add_token(token_id)
    assert detok.text == _stream_text(tokenizer, ids, True)
    gate.set()
    assert len(piece_table(tokenizer)) > len(tokenizer) // 2


def test_a_request_made_before_the_table_lands_takes_it_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request added while the table is built (every request of a server's first
    moments) decodes through the stream until the table lands, then looks its tokens up,
    with the same text as the stream alone."""
    tokenizer = make_tokenizer(8192)  # a fresh object: no table built for it yet
    gate = threading.Event()
    build = piece_table_module.build_piece_table

    def gated_build(tok: Any) -> dict[int, str]:
        assert gate.wait(10)
        return build(tok)

    monkeypatch.setattr(piece_table_module, "build_piece_table", gated_build)
    monkeypatch.setattr(detokenizer_module, "_decode_stream", _CountingStream)
    OutputProcessor(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    before = tokenizer.encode("Decoded through the stream while the table is built. " * 2)
    after = tokenizer.encode(" Then looked up once it has landed. " * 8)
    _CountingStream.steps = 0
    for token_id in before:
        detok.add_token(token_id)
    assert detok.text  # queued tokens are folded in when the text is read
    assert _CountingStream.steps == len(before)  # no table yet: every token decoded
    gate.set()
    assert len(piece_table(tokenizer)) > len(tokenizer) // 2  # waits for the build
    _CountingStream.steps = 0
    for token_id in after:
        detok.add_token(token_id)
    text = detok.text
    assert _CountingStream.steps <= 3, f"{_CountingStream.steps} of {len(after)} tokens decoded"
    assert text == _stream_text(tokenizer, before + after, True)
    assert detok.text == _stream_text(tokenizer, before + after, True)


@pytest.mark.parametrize("skip", [True, False])
def test_queued_tokens_fold_to_the_streams_text_whenever_read(tokenizer: Any, skip: bool) -> None:
    """Plain steps' tokens are queued and folded in when the text is read: read after
    any number of them (byte pieces and multi-byte characters split across the reads),
    the text is the stream's, byte for byte."""
    compared = 0
    for seed, ids in enumerate(_sequences(tokenizer, seed=2 + int(skip))):
        try:
            expected = _stream_text(tokenizer, ids, skip)
        except Exception:  # DecodeStream's "invalid prefix" on some runs of byte pieces
            continue
        rng = random.Random(seed)
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
        detok.update(ids[:1])
        for token_id in ids[1:]:
            detok.add_token(token_id)
            if rng.random() < 0.15:
                assert expected.startswith(detok.text)
        assert detok.text.encode() == expected.encode(), (ids, detok.text, expected)
        streamed = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip))
        streamed.update(ids[:1])
        for token_id in ids[1:]:  # a streaming request's tokens: decoded as they come
            streamed.add_token_to_text(token_id)
        assert streamed.text.encode() == expected.encode()
        compared += 1
    assert compared >= SEQUENCES * 3 // 4


def test_a_queued_run_of_table_tokens_is_one_gather(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Queued tokens that are all in the table, after one that left the text steady,
    fold as one gather: no token goes through the per-token path."""
    table = piece_table(tokenizer)
    run = [i for i in tokenizer.encode(TEXT, add_special_tokens=False) if i in table]
    assert len(run) > 20
    detok = IncrementalDetokenizer(tokenizer, SamplingParams())
    detok.update(run[:2])
    per_token = 0
    original = IncrementalDetokenizer._piece

    def counted(self: IncrementalDetokenizer, token_id: int) -> str:
        nonlocal per_token
        per_token += 1
        return original(self, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "_piece", counted)
    for token_id in run[2:]:
        detok.add_token(token_id)
    assert detok.text == _stream_text(tokenizer, run, True)
    assert per_token == 0
    detok.add_token(run[0])  # and the stream's state after the gather is the stream's
    assert detok.text == _stream_text(tokenizer, [*run, run[0]], True)

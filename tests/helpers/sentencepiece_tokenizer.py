"""SentencePiece-style fast tokenizers (metaspace, byte fallback), trained offline.

As Llama's and Mistral's ``tokenizer.json``: a BPE whose unknown characters fall back to
``<0xNN>`` byte tokens, ``▁`` for spaces, and either Llama's decoder sequence (replace,
byte fallback, fuse, strip the leading space) or byte fallback then ``Metaspace``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Literal

from enginecore.checkpoints import make_tokenizer

# Text the trainer sees besides the Python sources: multi-byte scripts and emoji, so that
# some of them get tokens of their own and the rest fall back to bytes.
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

    from enginecore.checkpoints import make_demo_checkpoint

    path: pathlib.Path = make_demo_checkpoint()
    return AutoTokenizer.from_pretrained(path)

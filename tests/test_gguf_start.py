"""What a GGUF start reads, read faster: the metadata through plain array views, the
tokenizer converted once per file and cached, Q8_0 tensors de-quantized in torch. Each
gives what the slower path gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginecore.builtin_models.gguf_archs import dequantized
from enginecore.builtin_models.gguf_reader import fast_reader_class
from tests.gguf_writer import write_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory, checkpoint_factory):
    return write_gguf(
        checkpoint_factory("llama"), tmp_path_factory.mktemp("gguf") / "q8.gguf", quantize=True
    )


def test_the_plain_view_reader_reads_what_gguf_reads(q8_gguf):
    reader_class = fast_reader_class()
    assert reader_class is not None  # this gguf's reader is the one it overrides
    stock, fast = gguf.GGUFReader(str(q8_gguf)), reader_class(str(q8_gguf))
    assert list(stock.fields) == list(fast.fields)
    for key, field in stock.fields.items():
        assert fast.fields[key].contents() == field.contents(), key
    assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
    for ours, theirs in zip(fast.tensors, stock.tensors, strict=True):
        assert ours.tensor_type == theirs.tensor_type and list(ours.shape) == list(theirs.shape)
        assert np.array_equal(ours.data, theirs.data), ours.name


def test_q8_0_is_dequantized_as_gguf_does(q8_gguf):
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(q8_gguf))
    q8 = [t for t in reader.tensors if t.tensor_type.name == "Q8_0"]
    assert q8
    for tensor in q8:
        ours = dequantized(tensor)
        want = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        assert torch.equal(ours, torch.from_numpy(want).reshape(ours.shape)), tensor.name


def test_a_gguf_tokenizer_is_converted_once_then_read_from_the_cache(
    q8_gguf, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    from enginecore.engine.tokenizer import gguf_tokenizer

    monkeypatch.setenv("ENGINECORE_CACHE_DIR", str(tmp_path))
    reference = AutoTokenizer.from_pretrained(str(q8_gguf.parent), gguf_file=q8_gguf.name)
    first = gguf_tokenizer(q8_gguf)
    saved = list((tmp_path / "gguf-tokenizers").iterdir())
    assert len(saved) == 1 and (saved[0] / "tokenizer_config.json").is_file()
    calls = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append((a, k)) or real(*a, **k)
    )
    second = gguf_tokenizer(q8_gguf)
    assert [k.get("gguf_file") for _, k in calls] == [None]  # read back, not converted
    text = "Hello, world! Ünïcode and   spaces\n<|im_start|>user"
    for tokenizer in (first, second):
        assert tokenizer(text)["input_ids"] == reference(text)["input_ids"]
        ids = reference(text)["input_ids"]
        assert tokenizer.decode(ids) == reference.decode(ids)
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
            reference.bos_token_id,
            reference.eos_token_id,
        )
        assert tokenizer.chat_template == reference.chat_template

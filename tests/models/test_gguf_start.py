"""What a GGUF start reads, read faster: the metadata without the token tables, the
tokenizer converted once per file and cached, Q8_0 tensors de-quantized in torch. Each
gives what the slower path gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginecore.block_formats.gguf_reader import GGUFMetadata, SkippedStrings
from enginecore_models.gguf_archs import dequantized
from tests.helpers.gguf_writer import write_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory, checkpoint_factory):
    return write_gguf(
        checkpoint_factory("llama"), tmp_path_factory.mktemp("gguf") / "q8.gguf", quantize=True
    )


def assert_reads_what_gguf_reads(path):
    stock, ours = gguf.GGUFReader(str(path)), GGUFMetadata(path)
    keys = [k for k in stock.fields if not k.startswith("GGUF.")]  # gguf's own entries
    assert keys == list(ours.fields)
    for key in keys:
        field = stock.fields[key]
        if field.types[:1] == [gguf.GGUFValueType.ARRAY] and field.types[-1] == (
            gguf.GGUFValueType.STRING
        ):
            assert ours.fields[key] == SkippedStrings(len(field.contents())), key
        else:
            assert ours.field(key) == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in stock.tensors]
    for mine, theirs in zip(ours.tensors, stock.tensors, strict=True):
        assert mine.tensor_type == theirs.tensor_type, mine.name
        assert list(mine.shape) == list(theirs.shape), mine.name
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            theirs.n_elements,
            theirs.n_bytes,
            theirs.data_offset,
        ), mine.name
        data = mine.data
        assert data.dtype == theirs.data.dtype and data.shape == theirs.data.shape, mine.name
        assert np.array_equal(data, theirs.data), mine.name


def test_the_header_reader_reads_what_gguf_reads(q8_gguf):
    assert_reads_what_gguf_reads(q8_gguf)


def test_the_header_reader_reads_every_value_type_and_either_byte_order(tmp_path):
    for order in (gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG):
        path = tmp_path / f"{order.name}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama", endianess=order)
        writer.add_uint8("t.u8", 200)
        writer.add_int8("t.i8", -100)
        writer.add_uint16("t.u16", 60000)
        writer.add_int16("t.i16", -30000)
        writer.add_uint32("t.u32", 4_000_000_000)
        writer.add_int32("t.i32", -2_000_000_000)
        writer.add_float32("t.f32", 0.1)
        writer.add_uint64("t.u64", 2**63 + 5)
        writer.add_int64("t.i64", -(2**62))
        writer.add_float64("t.f64", 0.1)
        writer.add_bool("t.bool", True)
        writer.add_string("t.str", "héllo")
        writer.add_array("t.ints", [1, 2, 3])
        writer.add_array("t.floats", [0.5, 1.5])
        writer.add_array("t.bools", [True, False, True])
        writer.add_array("t.strings", ["a", "bc", "", "défg"])
        writer.add_tensor("f32", np.arange(12, dtype=np.float32).reshape(3, 4))
        writer.add_tensor("f16", np.arange(8, dtype=np.float16).reshape(2, 4))
        writer.add_tensor("i32", np.arange(6, dtype=np.int32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert_reads_what_gguf_reads(path)
        assert GGUFMetadata(path).field("t.str") == "héllo"


def test_a_gguf_models_vocabulary_is_read_from_its_header(q8_gguf, tmp_path):
    from transformers import AutoConfig

    from enginecore.config import make_config
    from enginecore.structured_output.vocab import model_vocab_size

    want = AutoConfig.from_pretrained(str(q8_gguf.parent), gguf_file=q8_gguf.name).vocab_size
    assert GGUFMetadata(q8_gguf).vocab_size() == want
    assert model_vocab_size(make_config(model=str(q8_gguf)), tokenizer=[]) == want


def test_a_cut_gguf_header_is_a_clear_error(q8_gguf, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(q8_gguf.read_bytes()[:200])
    with pytest.raises(ValueError, match="cut short"):
        GGUFMetadata(cut)
    cut.write_bytes(b"GGML" + q8_gguf.read_bytes()[4:])
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFMetadata(cut)


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

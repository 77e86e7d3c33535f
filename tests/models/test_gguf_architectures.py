"""GGUF files of every architecture GGUF carries load with their config, tokenizer and
chat template taken from the file, and compute what the original checkpoint computes.

The files are written from the test checkpoints by ``gguf_writer`` the way llama.cpp's
converter writes them; transformers' own GGUF reader agreeing tensor for tensor proves
the conventions (where its config reader covers the architecture).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import torch

from enginecore import LLM, SamplingParams
from enginecore.errors import EngineCoreError
from enginecore_models.weight_loader import iter_weights, load_hf_config
from tests.helpers.gguf_writer import write_gguf
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.model_logits import ATOL, load_ours, new_cache, reference_logits, run_chunks

GGUF_ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3"]


@pytest.fixture(scope="module")
def gguf_files(checkpoint_factory, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, bool], pathlib.Path] = {}

    def make(arch: str, quantize: bool = False) -> pathlib.Path:
        key = (arch, quantize)
        if key not in made:
            name = f"{arch}{'-q8_0' if quantize else ''}.gguf"
            made[key] = write_gguf(checkpoint_factory(arch), root / name, quantize)
        return made[key]

    return make


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_gguf_logits_equal_the_original_checkpoint(
    gguf_files, checkpoint_factory, model_refs, arch
):
    path = gguf_files(arch)
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (29,))
    model = load_ours(path, model_refs)
    kv = new_cache(model, 12, 4)
    got = run_chunks(model, ids, [(0, 11), (11, 12), (12, 29)], 4, list(range(8)), kv)
    want = reference_logits(checkpoint_factory(arch), ids)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2", "gemma3", "phi3"])
def test_gguf_tensors_equal_transformers_gguf_reader(gguf_files, arch):
    """transformers reads llama.cpp's conventions (Q/K interleave, Gemma's 1 + w norms,
    Phi-3's fused tensors) the same way: same HF tensors, whichever reads the file."""
    from transformers import AutoModelForCausalLM

    path = gguf_files(arch)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).state_dict()
    cfg = load_hf_config(path)
    ours = dict(iter_weights(path, cfg))
    for name, tensor in ours.items():
        if name in ref:
            torch.testing.assert_close(tensor, ref[name].float(), atol=1e-6, rtol=0, msg=name)
    assert len(set(ours) & set(ref)) >= len(ours) - 1  # all but a tied head's absence


def test_quantized_gguf_equals_transformers_on_the_same_file(gguf_files, model_refs):
    """Q8_0 blocks de-quantized at load: the same weights transformers computes with."""
    from transformers import AutoModelForCausalLM

    path = gguf_files("qwen2", quantize=True)
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (21,))
    model = load_ours(path, model_refs)
    kv = new_cache(model, 8, 4)
    got = run_chunks(model, ids, [(0, 9), (9, 10), (10, 21)], 4, list(range(6)), kv)
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    with torch.no_grad():
        want = ref(ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_llm_serves_a_moe_gguf_with_its_tokenizer_and_chat_template(gguf_files, checkpoint_factory):
    from transformers import AutoTokenizer

    path = gguf_files("qwen3_moe")
    original = checkpoint_factory("qwen3_moe")
    text = "def main(argv):\n    return json.dumps(argv)"
    with LLM(str(path), dtype="float32", multiprocessing=False, num_blocks_override=32) as llm:
        ids = llm.tokenizer(text)["input_ids"]
        assert ids == AutoTokenizer.from_pretrained(original)(text)["input_ids"]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": ids}, params)[0]
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(original, ids, 8), "qwen3_moe gguf"
        )
        chat = llm.chat([{"role": "user", "content": "hi"}], params)[0]
        # The template written into the file: "<|bos|>role\ncontent<|eos|>\n" per turn.
        assert llm.tokenizer.decode(chat.prompt_token_ids) == (
            "<|bos|>user\nhi<|eos|>\n<|bos|>assistant\n"
        )


def test_gguf_with_a_tensor_type_that_cannot_be_dequantized_is_refused(gguf_files, tmp_path):
    import gguf

    src = gguf.GGUFReader(str(gguf_files("llama")))
    out = tmp_path / "f64.gguf"
    writer = gguf.GGUFWriter(str(out), "llama")
    for key, field in src.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for t in src.tensors:
        data = np.array(t.data, dtype=np.float32).reshape([int(d) for d in reversed(t.shape)])
        if t.name == "output_norm.weight":
            writer.add_tensor(
                t.name, data.astype(np.float64), raw_dtype=gguf.GGMLQuantizationType.F64
            )
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(EngineCoreError) as err:
        LLM(str(out), dtype="float32", multiprocessing=False)
    message = str(err.value)
    assert "F64" in message and "Q8_0" in message  # the type found, and what is supported
    assert "executor" not in message
    json.dumps(message)  # plain text


def test_llama3_rope_scaling_from_a_gguf_rope_freqs_tensor(tmp_path, model_refs):
    """Llama 3.x GGUF files carry their RoPE scaling as a ``rope_freqs`` tensor."""
    from enginecore.checkpoints import make_random_checkpoint

    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    original = make_random_checkpoint(
        tmp_path / "llama3", config_overrides={"rope_parameters": rope}
    )
    path = write_gguf(original, tmp_path / "llama3.gguf")
    torch.manual_seed(0)
    ids = torch.randint(3, 8000, (29,))
    model = load_ours(path, model_refs)
    kv = new_cache(model, 12, 4)
    got = run_chunks(model, ids, [(0, 11), (11, 12), (12, 29)], 4, list(range(8)), kv)
    torch.testing.assert_close(got, reference_logits(original, ids), atol=ATOL, rtol=0)

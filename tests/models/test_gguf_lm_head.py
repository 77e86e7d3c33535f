"""The ``gguf`` linear method's LM head: the logits come from the file's own blocks (a
head tied to the embedding reads ``token_embd``'s), through the projections' kernels,
while the lookup keeps its float table."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from enginecore.block_formats import kquant_blocks
from enginecore.block_formats.gguf_blocks import (
    Q4_0_HALF_SCALES,
    Q4_HALF_SCALES,
    Q8_HALF_SCALES,
    BlockWeight,
)
from enginecore.block_formats.kquant_blocks import KQuantWeight
from enginecore.block_formats.parts import unpacked
from enginecore.distributed import SINGLE_RANK
from enginecore.layers.embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_parallel_logits,
)
from enginecore.layers.linear import use_linear_method
from enginecore.layers.quantized import QuantizedTensor
from enginecore.testing.quantizers import quantize_k
from enginecore_cpu import kquant_kernels, quant_kernels
from enginecore_cpu.gguf_linear_method import DIRECT_MAX_ROWS, GGUFLinearMethod, blocks_linear

gguf_quants = pytest.importorskip("gguf.quants")
from gguf import GGMLQuantizationType  # noqa: E402

pytestmark = pytest.mark.skipif(
    quant_kernels.load() is None or kquant_kernels.load() is None, reason="no C compiler"
)

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
VOCAB, DIM = 200, 512


def file_tensor(weight: torch.Tensor, fmt: str) -> tuple[QuantizedTensor, torch.Tensor]:
    """``weight`` as a GGUF file stores it in ``fmt``, and gguf's de-quantized values."""
    qtype = GGMLQuantizationType[fmt]
    if fmt in kquant_blocks.FORMATS:
        raw = quantize_k(weight, fmt)
    else:
        raw = gguf_quants.quantize(weight.numpy(), qtype)
    reference = np.array(gguf_quants.dequantize(raw, qtype), np.float32).reshape(weight.shape)
    data = torch.from_numpy(np.ascontiguousarray(raw)).reshape(weight.shape[0], -1)
    return QuantizedTensor(data, fmt, tuple(weight.shape)), torch.from_numpy(reference)


def loaded_table(cls: type, loaded: QuantizedTensor) -> Any:
    with use_linear_method(GGUFLinearMethod(None)):
        layer = cls(VOCAB, DIM, parallel=SINGLE_RANK, dtype=torch.float32)
    layer.weight.weight_loader(layer.weight, loaded)
    layer.linear_method.process_weights_after_loading(layer)
    return layer


def file_format(part: Any) -> str:
    """The GGUF format whose layout ``part`` keeps (a file's blocks keep its float16
    scales), or "Q8_0 copy" for blocks quantized at load (float32 scales)."""
    if isinstance(part, KQuantWeight):
        return part.fmt
    assert isinstance(part, BlockWeight)
    kinds = {Q8_HALF_SCALES: "Q8_0", Q4_0_HALF_SCALES: "Q4_0", Q4_HALF_SCALES: "Q4_1"}
    return kinds.get(part.kind, "Q8_0 copy" if part.bits == 8 else f"kind {part.kind}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cls", [VocabParallelEmbedding, ParallelLMHead], ids=["tied", "head"])
def test_the_logits_come_from_the_files_blocks(fmt: str, cls: type):
    """A tied embedding or an output head in each format the kernels take: the logits are
    the projections' product on the file's blocks bit for bit (no Q8_0 copy of the
    table), within the activations' 8-bit rounding of gguf's de-quantized weight times
    torch, at one, a few and many rows; the lookup reads gguf's de-quantized rows."""
    torch.manual_seed(0)
    loaded, reference = file_tensor(torch.randn(VOCAB, DIM), fmt)
    layer = loaded_table(cls, loaded)
    blocks = layer.gguf_blocks
    assert [(first, file_format(part)) for first, part in blocks] == [(0, fmt)]
    file_blocks = [(0, unpacked(loaded))]
    for rows in (1, 3, DIRECT_MAX_ROWS + 5):
        x = torch.randn(rows, DIM)
        logits = vocab_parallel_logits(x, layer)
        assert torch.equal(logits, blocks_linear(file_blocks, x))
        want = F.linear(x, reference)
        assert ((logits - want).abs().max() / want.abs().max()).item() < 2e-2
    if cls is ParallelLMHead:  # never looked up: no float weight is kept
        assert layer.weight.numel() == 0
    else:
        ids = torch.tensor([0, 7, VOCAB - 1])
        assert torch.equal(layer.weight[ids], reference[ids])


def test_a_head_nobody_prepared_computes_from_its_blocks_at_first_use():
    """An output head keeps no float weight: a model that computes logits with it
    without calling ``process_weights_after_loading`` still gets the blocks' logits."""
    torch.manual_seed(0)
    loaded, reference = file_tensor(torch.randn(VOCAB, DIM), "Q4_0")
    with use_linear_method(GGUFLinearMethod(None)):
        head = ParallelLMHead(VOCAB, DIM, parallel=SINGLE_RANK, dtype=torch.float32)
    head.weight.weight_loader(head.weight, loaded)
    x = torch.randn(2, DIM)
    logits = head(x)
    assert torch.equal(logits, blocks_linear([(0, unpacked(loaded))], x))
    want = F.linear(x, reference)
    assert ((logits - want).abs().max() / want.abs().max()).item() < 2e-2


def test_a_float_table_keeps_a_q8_0_copy_for_its_logits():
    """A table that came in float (a format the kernels do not take) still computes its
    logits from blocks: a Q8_0 copy of it, within that rounding of the float product."""
    torch.manual_seed(0)
    table = torch.randn(VOCAB, DIM)
    with use_linear_method(GGUFLinearMethod(None)):
        layer = VocabParallelEmbedding(VOCAB, DIM, parallel=SINGLE_RANK, dtype=torch.float32)
    layer.weight.weight_loader(layer.weight, table)
    layer.linear_method.process_weights_after_loading(layer)
    assert [(first, file_format(part)) for first, part in layer.gguf_blocks] == [(0, "Q8_0 copy")]
    x = torch.randn(2, DIM)
    want = F.linear(x, table)
    got = vocab_parallel_logits(x, layer)
    assert ((got - want).abs().max() / want.abs().max()).item() < 2e-2


def _tied(checkpoint: Any, out: Any) -> Any:
    """``checkpoint`` with its head tied to the embedding (no ``lm_head.weight``)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(checkpoint, out)
    tensors = load_file(out / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "output"])
def test_a_q4_0_file_computes_its_logits_from_its_head_blocks(tiny_llama, tmp_path, tied):
    """A whole Q4_0 file, its head tied to ``token_embd`` or its own ``output``: the
    engine's logits head keeps the file's Q4_0 blocks, and decodes greedily as
    transformers does on the file: fed the engine's tokens, up to the first step whose
    top two logits are within the activations' 8-bit rounding each token is its argmax,
    and after it within that rounding of the argmax."""
    from transformers import AutoModelForCausalLM

    from enginecore import LLM, SamplingParams
    from tests.helpers.gguf_writer import write_gguf

    checkpoint = _tied(tiny_llama, tmp_path / "tied") if tied else tiny_llama
    path = write_gguf(checkpoint, tmp_path / "q4_0.gguf", types=lambda name: "Q4_0")
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(path), multiprocessing=False) as llm:
        head = llm.collective_rpc(
            lambda w: [
                (type(w.model_runner.model.logits_head()).__name__, first, file_format(p))
                for first, p in w.model_runner.model.logits_head().gguf_blocks
            ]
        )[0]
        got = llm.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    assert head == [("VocabParallelEmbedding" if tied else "ParallelLMHead", 0, "Q4_0")], head
    ref = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    assert ref.config.tie_word_embeddings == tied
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + list(got)])).logits[0, len(prompt) - 1 : -1]
    tol = 0.02 * float(logits.abs().max())
    top2 = logits.topk(2, -1).values
    first_tie = [*(top2[:, 0] - top2[:, 1] <= tol).tolist(), True].index(True)
    assert list(got[:first_tie]) == logits.argmax(-1).tolist()[:first_tie], first_tie
    chosen = logits[torch.arange(len(got)), torch.tensor(list(got))]
    assert (top2[:, 0] - chosen <= tol).all()

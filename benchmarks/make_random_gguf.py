"""Write a Llama-shaped GGUF file of a real model's size with random weights, for load
and decode benchmarks (speed does not depend on the weights' values).

Every 2-D weight is written in ``--format`` as random blocks (``Q4_K_M``: V and the down
projection in Q6_K, the rest in Q4_K; ``Q5_K_M``: llama.cpp's mix, the tied head and V
and the down projection of its "more bits" layers in Q6_K, the rest in Q5_K) whose
float16 scales are small finite numbers; norms are float32 ones; the tokenizer is the demo GGUF's (the
SmolLM2 tokenizer, shared by every SmolLM2 size). The default shape is SmolLM2-1.7B's
(hidden 2048, 24 layers, 32 heads, MLP 8192, tied embedding: 1.0 GB at Q4_0).

    python benchmarks/make_random_gguf.py OUT.gguf [--format Q4_0] [--layers 24] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

# Byte offsets of each block's float16 fields (scales, minimums) in GGUF's layouts.
HALF_OFFSETS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(rows: int, cols: int, fmt: str, rng: np.random.Generator) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType[fmt]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    nblocks = rows * cols // block
    data = rng.integers(0, 256, size=(nblocks, size), dtype=np.uint8)
    for offset in HALF_OFFSETS[fmt]:
        scales = rng.uniform(1e-3, 2e-2, size=nblocks).astype(np.float16)
        data[:, offset : offset + 2] = scales.view(np.uint8).reshape(nblocks, 2)
    return data.reshape(rows, cols // block * size)


def write(args: argparse.Namespace) -> pathlib.Path:
    import gguf

    from enginecore.checkpoints import find_demo_gguf
    from enginecore.testing.quantizers import q5_k_m_type

    rng = np.random.default_rng(args.seed)
    head_dim = args.hidden // args.heads
    writer = gguf.GGUFWriter(str(args.out), "llama")
    writer.add_context_length(args.context)
    writer.add_embedding_length(args.hidden)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.intermediate)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(130000.0)
    writer.add_rope_dimension_count(head_dim)
    demo = gguf.GGUFReader(str(find_demo_gguf()))
    for key, field in demo.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    vocab = len(demo.fields["tokenizer.ggml.tokens"].contents())
    if args.vocab is not None and args.vocab != vocab:  # a head of another width (Llama 3's)
        vocab = args.vocab
        writer.add_vocab_size(vocab)

    def matrix(name: str, rows: int, cols: int) -> None:
        fmt = args.format
        if fmt == "Q4_K_M":
            fmt = "Q6_K" if ("attn_v" in name or "ffn_down" in name) else "Q4_K"
        elif fmt == "Q5_K_M":
            fmt = q5_k_m_type(name, args.layers, tied=True)  # the head is the embedding
        qtype = gguf.GGMLQuantizationType[fmt]
        writer.add_tensor(name, random_blocks(rows, cols, fmt, rng), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(args.hidden, dtype=np.float32))

    kv = args.kv_heads * head_dim
    matrix("token_embd.weight", vocab, args.hidden)
    for i in range(args.layers):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", args.hidden, args.hidden)
        matrix(f"blk.{i}.attn_k.weight", kv, args.hidden)
        matrix(f"blk.{i}.attn_v.weight", kv, args.hidden)
        matrix(f"blk.{i}.attn_output.weight", args.hidden, args.hidden)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", args.intermediate, args.hidden)
        matrix(f"blk.{i}.ffn_up.weight", args.intermediate, args.hidden)
        matrix(f"blk.{i}.ffn_down.weight", args.hidden, args.intermediate)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return args.out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument(
        "--format", choices=[*sorted(HALF_OFFSETS), "Q4_K_M", "Q5_K_M"], default="Q4_0"
    )
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=32)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocab", type=int, help="embedding and tied-head rows (default: the tokenizer's)"
    )
    path = write(parser.parse_args())
    print(f"wrote {path} ({path.stat().st_size / 1e9:.2f} GB)")


if __name__ == "__main__":
    main()

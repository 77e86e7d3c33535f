"""One Mixtral step, enginecore against transformers, on the same random checkpoint.

The checkpoint: hidden 512, 2 layers, 8 heads / 2 KV heads, 8 experts of intermediate
1024, top-2 (about 27M parameters, float32). Two steps are timed, each the median of
``--repeats`` runs after warm-up:

- prefill: one 256-token prompt, the whole model forward (logits of the last token);
- decode: 32 requests with 64 tokens of context each, one new token per request.

transformers runs the same forward with its own KV cache (``DynamicCache``), eager
attention; enginecore runs its model over the paged cache, as the model runner does.

    python benchmarks/moe_step.py [--json benchmarks/results/moe_step.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import statistics
import tempfile
import time

import torch


def make_checkpoint(root: pathlib.Path) -> pathlib.Path:
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = root / "mixtral-bench"
    model.save_pretrained(path)
    return path


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e3


def enginecore_steps(path: pathlib.Path, prompt: int, batch: int, context: int, repeats: int):
    """The model as the engine runs it (the runner's attention backend and linear method),
    one prefill step and one decode step driven directly."""
    from enginecore import make_config
    from enginecore.engine.components import resolve_components
    from enginecore.plugins import make_plugin_manager
    from enginecore.testing.attention_steps import make_batch, step_context
    from enginecore_models.model_runner import TorchModelRunner

    config = make_config(model=str(path), dtype="float32", max_num_seqs=max(batch, 1))
    runner = TorchModelRunner(config, resolve_components(config, make_plugin_manager()).worker_spec)
    runner.load_model()
    model = runner.model
    bs = 16
    blocks_per_req = -(-(context + 1) // bs)
    prompt_blocks = -(-prompt // bs)
    runner.initialize_kv_cache(max(batch * blocks_per_req, prompt_blocks) + 1)
    backend, kv = runner.attn_backend, runner.kv_caches

    ids = torch.randint(3, 8000, (prompt,))
    pos = torch.arange(prompt)
    prompt_batch = make_batch([prompt], [0], [list(range(prompt_blocks))], bs)

    def prefill():
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, kv, step_context(backend, prompt_batch))[-1:])

    tables = [list(range(r * blocks_per_req, (r + 1) * blocks_per_req)) for r in range(batch)]
    decode_batch = make_batch([1] * batch, [context] * batch, tables, bs)
    dpos = torch.full((batch,), context)
    dids = torch.randint(3, 8000, (batch,))

    def decode():
        with torch.inference_mode():
            model.compute_logits(model(dids, dpos, kv, step_context(backend, decode_batch)))

    return timed(prefill, repeats), timed(decode, repeats)


def transformers_steps(path: pathlib.Path, prompt: int, batch: int, context: int, repeats: int):
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(3, 8000, (1, prompt))

    def prefill():
        with torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)

    ctx = torch.randint(3, 8000, (batch, context))
    with torch.inference_mode():
        cache = model(ctx, past_key_values=DynamicCache(config=model.config)).past_key_values
    nxt = torch.randint(3, 8000, (batch, 1))

    def decode():
        step_cache = copy.deepcopy(cache)  # each run decodes from the same context
        with torch.inference_mode():
            model(nxt, past_key_values=step_cache)

    def copy_only():
        copy.deepcopy(cache)

    decode_ms = timed(decode, repeats) - timed(copy_only, repeats)
    return timed(prefill, repeats), decode_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(pathlib.Path(tmp))
        ours = enginecore_steps(path, args.prompt, args.batch, args.context, args.repeats)
        theirs = transformers_steps(path, args.prompt, args.batch, args.context, args.repeats)
    result = {
        "model": "Mixtral, hidden 512, 2 layers, 8 experts top-2, float32",
        "threads": torch.get_num_threads(),
        "prefill_tokens": args.prompt,
        "decode_batch": args.batch,
        "decode_context": args.context,
        "enginecore_ms": {"prefill": round(ours[0], 2), "decode": round(ours[1], 2)},
        "transformers_ms": {"prefill": round(theirs[0], 2), "decode": round(theirs[1], 2)},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

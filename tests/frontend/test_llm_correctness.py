"""LLM.generate is token-for-token equal to transformers' greedy generate.

Alone and in mixed batches, with chunked prefill forced small, prefix caching on with
shared prefixes, a KV cache small enough to force preemption, sync and async scheduling,
in-process and with the engine in its own process.
"""

from __future__ import annotations

import pytest

from enginecore import LLM, SamplingParams
from tests.helpers.hf_reference import assert_matches_reference, greedy_reference
from tests.helpers.prompts import mixed_prompts


def leaks(llm: LLM) -> list[str]:
    """Block and request leaks once the engine is quiet (finished ids reached the worker)."""
    engine = llm.engine_client.engine
    step = engine.step_fn()
    while engine.has_work():
        step()
    return engine.scheduler.leak_report()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_single_prompt_matches_transformers(checkpoint_factory, arch: str) -> None:
    path = checkpoint_factory(arch)
    prompt = mixed_prompts(1)[5]
    with LLM(path, dtype="float32", multiprocessing=False, num_blocks_override=64) as llm:
        out = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        )[0]
        assert out.outputs[0].finish_reason == "length"
        assert_matches_reference(out.outputs[0].token_ids, greedy_reference(path, prompt, 12), arch)
        assert leaks(llm) == []


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_batch_chunked_prefix_cached_preempted(
    checkpoint_factory, arch: str, async_scheduling: bool
) -> None:
    path = checkpoint_factory(arch)
    prompts = mixed_prompts(2)
    max_tokens = 10
    with LLM(
        path,
        dtype="float32",
        multiprocessing=False,
        async_scheduling=async_scheduling,
        max_num_batched_tokens=32,  # long prompts are split across steps
        max_num_seqs=16,
        block_size=16,
        prefix_caching=True,
        num_blocks_override=24,  # 23 usable blocks for ~60 blocks of demand: preemption
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
        assert [o.request_id for o in outputs] == sorted(
            (o.request_id for o in outputs), key=int
        ), "outputs come back in input order"
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.prompt_token_ids == prompt
            assert_matches_reference(
                out.outputs[0].token_ids,
                greedy_reference(path, prompt, max_tokens),
                f"{arch} prompt of {len(prompt)}",
            )
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption forced"
        assert any(o.num_cached_tokens > 0 for o in outputs), "no prefix-cache hit"
        assert leaks(llm) == []


@pytest.mark.parametrize("backend", ["torch", "cpu", "cpu without kernels"])
def test_each_attention_backend_matches_transformers(tiny_llama, backend: str, monkeypatch) -> None:
    """The same mixed, chunked, prefix-cached, preempted batch through each CPU backend
    (``triton`` runs it in test_triton_attention.py, under the interpreter). Without its
    kernels (no C compiler, or switched off) the ``cpu`` backend runs the torch paths; the
    engine process is then a fresh one that never loaded them."""
    prompts = mixed_prompts(2)
    in_process = backend != "cpu without kernels"
    if not in_process:
        monkeypatch.setenv("ENGINECORE_CPU_KERNELS", "0")
    backend = backend.split()[0]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=not in_process,
        attention_backend=backend,
        max_num_batched_tokens=32,
        block_size=16,
        num_blocks_override=24,
    ) as llm:
        [used] = llm.collective_rpc(lambda w: w.model_runner.attn_backend.name)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        )
        assert used == backend
        for prompt, out in zip(prompts, outputs, strict=True):
            assert_matches_reference(
                out.outputs[0].token_ids, greedy_reference(tiny_llama, prompt, 10), backend
            )
        assert sum(o.metrics["num_preemptions"] for o in outputs) > 0, "no preemption forced"
        assert any(o.num_cached_tokens > 0 for o in outputs), "no prefix-cache hit"
        if in_process:
            assert leaks(llm) == []


def test_multiprocess_async_engine_matches_transformers(tiny_llama) -> None:
    prompts = mixed_prompts(3)[:8]
    with LLM(tiny_llama, dtype="float32", max_num_batched_tokens=64) as llm:
        assert type(llm.engine_client).__name__ == "SyncMPClient"
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        )
    for prompt, out in zip(prompts, outputs, strict=True):
        assert_matches_reference(
            out.outputs[0].token_ids, greedy_reference(tiny_llama, prompt, 8), "mp"
        )


def test_seeded_sampling_is_reproducible_across_runs_and_batches(tiny_llama) -> None:
    prompts = mixed_prompts(4)
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    with LLM(tiny_llama, dtype="float32", multiprocessing=False) as llm:
        alone = llm.generate({"prompt_token_ids": prompts[0]}, seeded)[0].outputs[0].token_ids
        again = llm.generate({"prompt_token_ids": prompts[0]}, seeded)[0].outputs[0].token_ids
        others = [
            SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0.7, seed=99, ignore_eos=True),
            SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        ]
        batch = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], [seeded, *others])
        unseeded = llm.generate(
            [{"prompt_token_ids": prompts[0]}] * 2,
            SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
        )
        assert leaks(llm) == []
    assert alone == again
    assert batch[0].outputs[0].token_ids == alone
    # Without a seed, two samples of a random model's 8k vocabulary practically never agree.
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_text_stop_strings_and_token_ids(tiny_llama) -> None:
    with LLM(tiny_llama, dtype="float32", multiprocessing=False) as llm:
        prompt = "def parse(self, data):\n    return"
        full = llm.generate(
            prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )[0]
        text = full.outputs[0].text
        tokens = full.outputs[0].token_ids
        assert text == llm.get_tokenizer().decode(tokens)
        # A stop string taken from the middle of the greedy text cuts the output there.
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        assert stop.strip(), text
        cut = llm.generate(
            prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
        )[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == text[: text.index(stop)]
        kept = llm.generate(
            prompt,
            SamplingParams(
                max_tokens=24,
                temperature=0.0,
                ignore_eos=True,
                stop=[stop],
                include_stop_str_in_output=True,
            ),
        )[0].outputs[0]
        assert kept.text == text[: text.index(stop) + len(stop)]
        # A stop token id ends the request with that token kept as the last output.
        by_token = llm.generate(
            prompt,
            SamplingParams(
                max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[tokens[4]]
            ),
        )[0].outputs[0]
        assert by_token.token_ids == tokens[: tokens.index(tokens[4]) + 1]
        assert by_token.finish_reason == "stop" and by_token.stop_reason == tokens[4]
        assert leaks(llm) == []


def test_logprobs_and_parallel_sampling(tiny_llama) -> None:
    with LLM(tiny_llama, dtype="float32", multiprocessing=False) as llm:
        out = llm.generate(
            "hello", SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
        )[0].outputs[0]
        assert len(out.logprobs) == 5
        for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
            assert token_id in entry and len(entry) >= 3
            assert entry[token_id].rank == 1  # greedy: the sampled token is the top one
            assert all(lp.logprob <= 0.0 for lp in entry.values())
        multi = llm.generate(
            "hello", SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, ignore_eos=True)
        )[0]
        assert [c.index for c in multi.outputs] == [0, 1, 2]
        assert all(len(c.token_ids) == 6 for c in multi.outputs)
        assert len({tuple(c.token_ids) for c in multi.outputs}) > 1
        assert leaks(llm) == []

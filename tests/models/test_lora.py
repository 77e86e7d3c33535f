"""LoRA adapters: PEFT's tokens for each adapter in a mixed batch, and what is refused.

Three adapters made offline with PEFT's own ``LoraConfig`` (different ranks, target
modules, rsLoRA on one) and the base model run in the same steps, with chunked prefill
and prefix caching on, through the ``cpu`` and ``torch`` attention backends; each
request's greedy tokens equal transformers + PEFT on its adapter.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch

from enginecore import LLM, SamplingParams
from enginecore.config import make_config
from enginecore.errors import ConfigError, InvalidRequestError
from enginecore.lora import LoRARequest
from enginecore.lora.random_adapter import make_random_adapter
from enginecore.lora_request import LoRALoadReport

pytest.importorskip("peft")

ADAPTERS = {
    # name: (rank, alpha, targets, rslora)
    "qv8": (8, 16, ("q_proj", "v_proj"), False),
    "all16": (
        16,
        32,
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        True,
    ),
    "mlp4": (4, 8, ("o_proj", "gate_proj", "down_proj"), False),
}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        path = make_random_adapter(
            tiny_llama,
            root / name,
            r=r,
            lora_alpha=alpha,
            target_modules=targets,
            use_rslora=rslora,
            seed=i + 1,
        )
        out[name] = LoRARequest(name, i + 1, str(path))
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(10, 8192) for _ in range(20)]
    return [shared + [rng.randrange(10, 8192) for _ in range(5 + 7 * i)] for i in range(n)]


@functools.lru_cache(maxsize=8)
def peft_model(base: str, adapter_path: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter_path is not None:
        model = PeftModel.from_pretrained(model, adapter_path)
    return model.eval()


def reference(base, lora: LoRARequest | None, prompt: list[int]) -> list[int]:
    model = peft_model(str(base), lora.lora_path if lora else None)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_mixed_batch_matches_peft(tiny_llama, adapters, backend: str) -> None:
    loras = [None, *adapters.values()]
    batch = prompts(8)
    per_prompt = [loras[i % len(loras)] for i in range(len(batch))]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        attention_backend=backend,
        enable_lora=True,
        max_loras=3,  # the base and three adapters in one step
        max_lora_rank=16,
        max_num_batched_tokens=40,  # prompts are chunked
        block_size=8,
        prefix_caching=True,
        num_blocks_override=128,
    ) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            params,
            lora_request=per_prompt,
            use_tqdm=False,
        )
        for prompt, lora, out in zip(batch, per_prompt, outputs, strict=True):
            name = lora.lora_name if lora else "base"
            assert out.outputs[0].token_ids == reference(tiny_llama, lora, prompt), name
        # The same prompts again, each with another adapter: the prefix cache holds
        # every prompt's blocks, but only for the adapter that computed them.
        shifted = [loras[(i + 1) % len(loras)] for i in range(len(batch))]
        again = llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            params,
            lora_request=shifted,
            use_tqdm=False,
        )
        for prompt, lora, out in zip(batch, shifted, again, strict=True):
            name = lora.lora_name if lora else "base"
            assert out.outputs[0].token_ids == reference(tiny_llama, lora, prompt), name
        different = sum(
            a.outputs[0].token_ids != b.outputs[0].token_ids
            for a, b in zip(outputs, again, strict=True)
        )
        assert different >= len(batch) // 2, "adapters must change the output"


def test_fewer_slots_than_adapters_evicts_and_waits(tiny_llama, adapters) -> None:
    """max_loras=1, max_cpu_loras=2: the scheduler runs one adapter per step; slots and
    the host cache evict the least recently used; tokens still equal PEFT's."""
    loras = [None, *adapters.values()]
    batch = prompts(6, seed=3)
    per_prompt = [loras[i % len(loras)] for i in range(len(batch))]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        enable_lora=True,
        max_loras=1,
        max_cpu_loras=2,
        max_lora_rank=16,
        num_blocks_override=96,
        async_scheduling=True,
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            lora_request=per_prompt,
            use_tqdm=False,
        )
        for prompt, lora, out in zip(batch, per_prompt, outputs, strict=True):
            assert out.outputs[0].token_ids == reference(tiny_llama, lora, prompt)
        manager = llm.engine_client.engine.executor.worker.model_runner.lora
        assert len(manager.host) <= 2 and len(manager.slot_of) == 1


def test_refused_adapters_name_the_setting(tiny_llama, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def save(name: str, **kw) -> str:
        model = AutoModelForCausalLM.from_pretrained(str(tiny_llama))
        get_peft_model(model, LoraConfig(**kw)).save_pretrained(str(tmp_path / name))
        return str(tmp_path / name)

    dora = save("dora", r=4, target_modules=["q_proj"], use_dora=True)
    big = save("big", r=32, target_modules=["q_proj"])
    embed = save("embed", r=4, target_modules=["embed_tokens"])
    head = save("head", r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        enable_lora=True,
        max_lora_rank=16,
        num_blocks_override=32,
    ) as llm:
        cases = [
            (dora, "use_dora"),
            (big, "max_lora_rank=16"),
            (embed, "embedding"),
            (head, "modules_to_save"),
            (str(tmp_path / "none"), "adapter_config.json"),
        ]
        for i, (path, words) in enumerate(cases):
            with pytest.raises(InvalidRequestError, match=words):
                llm.generate("hello", lora_request=LoRARequest(f"x{i}", i + 1, path))
        # The engine still serves.
        assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)
    with (
        LLM(tiny_llama, dtype="float32", multiprocessing=False, num_blocks_override=32) as llm,
        pytest.raises(InvalidRequestError, match="--enable-lora"),
    ):
        llm.generate("hello", lora_request=LoRARequest("a", 1, dora))


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"speculative_method": "ngram", "num_speculative_tokens": 2}, "speculative"),
        ({"kv_transfer": {"connector": "shared_storage"}}, "KV connectors"),
        ({"pipeline_parallel_size": 2}, "pipeline"),
    ],
)
def test_lora_refuses_what_it_does_not_serve(overrides, words) -> None:
    with pytest.raises(ConfigError, match=words):
        make_config(model="m", enable_lora=True, **overrides)


def test_scheduler_admits_at_most_max_loras_adapters_per_step() -> None:
    from enginecore.request import Request
    from enginecore_schedulers.policies import FCFSPolicy
    from enginecore_schedulers.scheduler import DefaultScheduler

    config = make_config(model="m", enable_lora=True, max_loras=2, max_num_batched_tokens=512)
    sched = DefaultScheduler(config, num_blocks=64, max_model_len=256, policy=FCFSPolicy(config))
    loras = [LoRARequest(f"a{i}", i + 1, f"/p{i}") for i in range(3)]
    for i in range(6):
        sched.add_request(
            Request(
                str(i),
                [1] * 8,
                SamplingParams(max_tokens=4),
                seq_no=i,
                lora_request=loras[i % 3] if i < 5 else None,
            )
        )
    # No adapter is read yet: the base request runs, the others wait and ask for reads.
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"5"}
    assert {lora.lora_int_id for lora in out.lora_loads} == {1, 2, 3}
    sched.lora_admission.apply(LoRALoadReport(loaded=[1, 2, 3]))
    out = sched.schedule()
    ids = {r.lora_request.lora_int_id for r in sched.running if r.lora_request}
    assert len(ids) == 2
    assert set(out.num_scheduled_tokens) == {"0", "1", "3", "4", "5"}
    assert out.lora_loads == []
    stats = sched.make_stats()
    assert stats.running_lora_adapters == {"a0": 2, "a1": 2}
    assert stats.waiting_lora_adapters == {"a2": 1}


@pytest.mark.slow
def test_tensor_parallel_shards_the_delta_as_the_base_layer(tiny_llama, adapters) -> None:
    """TP=2 (two mp ranks joined by gloo): each rank holds its shard of every adapter's
    B rows (column-parallel, fused QKV and gate/up) and A columns (row-parallel, the
    partial delta summed by the all-reduce); tokens still equal PEFT's."""
    loras = [None, *adapters.values()]
    batch = prompts(4, seed=5)
    per_prompt = [loras[i % len(loras)] for i in range(len(batch))]
    with LLM(
        tiny_llama,
        dtype="float32",
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        num_blocks_override=64,
    ) as llm:
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            lora_request=per_prompt,
            use_tqdm=False,
        )
    for prompt, lora, out in zip(batch, per_prompt, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(tiny_llama, lora, prompt)


def test_preempted_requests_resume_with_their_adapter(tiny_llama, adapters) -> None:
    """A KV cache too small for the batch: requests are preempted and recomputed, and come
    back to the runner with their adapter (async scheduling on)."""
    loras = [None, *adapters.values()]
    batch = prompts(8, seed=7)
    per_prompt = [loras[i % len(loras)] for i in range(len(batch))]
    with LLM(
        tiny_llama,
        dtype="float32",
        multiprocessing=False,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=16,
        block_size=8,
        num_blocks_override=14,  # 13 usable blocks; the longest request needs 11
        max_num_batched_tokens=32,  # several prompts admitted at once, then they run out
        async_scheduling=True,
    ) as llm:
        scheduler = llm.engine_client.engine.scheduler
        preempted: list[str] = []
        preempt = scheduler._preempt

        def counting(request):
            preempted.append(request.request_id)
            preempt(request)

        scheduler._preempt = counting
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in batch],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
            lora_request=per_prompt,
            use_tqdm=False,
        )
    assert preempted, "the KV cache was meant to force preemption"
    for prompt, lora, out in zip(batch, per_prompt, outputs, strict=True):
        assert out.outputs[0].token_ids == reference(tiny_llama, lora, prompt)

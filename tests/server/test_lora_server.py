"""The OpenAI surface of LoRA: ``enginecore serve BASE --enable-lora --lora-modules
a=PATH_A b=PATH_B`` answers ``model: "a"`` and ``model: "b"`` requests interleaved under
load with PEFT's tokens, lists both in ``/v1/models`` with their parent, loads a third
adapter at run time without a restart, and exports ``vllm:lora_requests_info``."""

from __future__ import annotations

import concurrent.futures
import functools
import random
import shutil

import httpx
import openai
import pytest
import torch

from enginecore.lora.random_adapter import make_random_adapter
from tests.helpers.serve_process import free_port, start_cli, stop, wait_healthy

pytest.importorskip("peft")
MAX_TOKENS = 6


@functools.lru_cache(maxsize=4)
def peft_model(base: str, adapter: str | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def peft_tokens(base, adapter: str | None, prompt: list[int]) -> list[int]:
    model = peft_model(str(base), adapter)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def test_serve_lora_modules_interleaved_and_loaded_at_run_time(tiny_llama, tmp_path) -> None:
    paths = {
        "a": make_random_adapter(tiny_llama, tmp_path / "a", r=8, seed=1),
        "b": make_random_adapter(
            tiny_llama,
            tmp_path / "b",
            r=16,
            lora_alpha=8,
            target_modules=("k_proj", "o_proj", "up_proj", "down_proj"),
            seed=2,
        ),
        "c": make_random_adapter(
            tiny_llama, tmp_path / "c", r=4, target_modules=("gate_proj",), seed=3
        ),
        # What "c" is loaded again from after it is unloaded.
        "c2": make_random_adapter(
            tiny_llama, tmp_path / "c2", r=8, target_modules=("q_proj", "o_proj"), seed=4
        ),
    }
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8192) for _ in range(9 + 3 * i)] for i in range(3)]
    flags = [
        "--dtype", "float32", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--num-blocks-override", "256", "--allow-runtime-lora-updating",
        "--metrics-name-compat", "vllm", "--lora-modules", f"a={paths['a']}", f"b={paths['b']}",
    ]  # fmt: skip
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_cli(["serve", str(tiny_llama), "--port", str(port), *flags], log)
    url = f"http://127.0.0.1:{port}"
    try:
        # PEFT's tokens are computed here while the server's processes start.
        expected = {
            (name, i): peft_tokens(tiny_llama, str(paths[name]) if name != "base" else None, p)
            for name in ("base", "a", "b", "c")
            for i, p in enumerate(prompts)
        }
        wait_healthy(url, proc, log)
    except BaseException:
        stop(proc)
        raise
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        base = str(tiny_llama)
        assert set(models) == {base, "a", "b"}
        assert models["a"].parent == base and models["b"].parent == base

        def complete(name: str, i: int) -> tuple[tuple[str, int], list[int]]:
            reply = client.completions.create(
                model=base if name == "base" else name,
                prompt=prompts[i],
                max_tokens=MAX_TOKENS,
                temperature=0.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            assert reply.model == (base if name == "base" else name)
            return (name, i), reply.choices[0].model_extra["token_ids"]

        jobs = [(n, i) for _ in range(2) for i in range(len(prompts)) for n in ("a", "b", "base")]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            for key, tokens in pool.map(lambda job: complete(*job), jobs):
                assert tokens == expected[key], key

        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt=prompts[0], max_tokens=2)
        answer = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["c"])}
        )
        assert answer.status_code == 200, answer.text
        assert "c" in {m.id for m in client.models.list().data}
        for i in range(len(prompts)):
            assert complete("c", i)[1] == expected[("c", i)]
        # A bad adapter is refused with the reason; the server serves on.
        bad = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(tmp_path)}
        )
        assert bad.status_code == 400 and "adapter_config.json" in bad.text
        # One whose config and header pass but whose tensors the engine cannot take: the
        # load answers once the engine has tried to read it, with the engine's reason.
        broken = tmp_path / "broken"
        shutil.copytree(paths["c"], broken)
        config = broken / "adapter_config.json"
        config.write_text(config.read_text().replace('"r": 4', '"r": 2'))
        bad = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "e", "lora_path": str(broken)}
        )
        assert bad.status_code == 400, bad.text
        assert "'e'" in bad.text and str(broken) in bad.text and "rank r=2" in bad.text
        assert "e" not in {m.id for m in client.models.list().data}
        metrics = httpx.get(url + "/metrics").text
        info = [
            line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")
        ]
        assert len(info) == 1 and 'max_lora="2"' in info[0], info
        gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert gone.status_code == 200
        assert "c" not in {m.id for m in client.models.list().data}
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="c", prompt=prompts[0], max_tokens=2)
        assert complete("a", 0)[1] == expected[("a", 0)]
        # The same name loaded again from another path serves the new weights.
        answer = httpx.post(
            url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(paths["c2"])}
        )
        assert answer.status_code == 200, answer.text
        assert complete("c", 0)[1] == peft_tokens(tiny_llama, str(paths["c2"]), prompts[0])
    finally:
        stop(proc)

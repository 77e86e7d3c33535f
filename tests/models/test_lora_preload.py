"""The ``--lora-modules`` adapters are read while the engine starts (as vLLM preloads
them): the first request naming one needs no read, and an entry the engine cannot serve
fails start-up naming the adapter, its path and the setting, in ``LLM(...)`` and in
``enginecore serve`` (real processes).

Reads are counted through each worker's loader (the ``lora_state`` RPC), not timed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from enginecore import LLM, SamplingParams
from enginecore.lora.random_adapter import make_random_adapter
from enginecore.lora_request import LoRARequest
from tests.helpers.peft_reference import peft_greedy
from tests.helpers.serve_process import free_port

pytest.importorskip("peft")

MAX_TOKENS = 6
PROMPT = [11, 523, 87, 1999, 4, 250, 31, 77, 908]


def peft_tokens(base: str, adapter: str | None) -> list[int]:
    return peft_greedy(base, adapter, tuple(PROMPT), MAX_TOKENS)


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("preload")
    return {
        "a": str(make_random_adapter(tiny_llama, root / "a", r=8, seed=1)),
        "b": str(
            make_random_adapter(
                tiny_llama, root / "b", r=4, target_modules=("o_proj", "down_proj"), seed=2
            )
        ),
        "c": str(make_random_adapter(tiny_llama, root / "c", r=8, target_modules=("up_proj",))),
        "wide": str(make_random_adapter(tiny_llama, root / "wide", r=16, seed=4)),
    }


def broken_adapter(adapter: str, dest) -> str:
    """Config and header pass every frontend check; only reading the tensors finds that
    they do not have the config's rank."""
    shutil.copytree(adapter, dest)
    config = dest / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 8', '"r": 4'))
    return str(dest)


def settings(base, modules: list[str], **overrides) -> dict:
    return {
        "model": str(base),
        "dtype": "float32",
        "enable_lora": True,
        "max_lora_rank": 8,
        "num_blocks_override": 64,
        "lora_modules": modules,
        **overrides,
    }


def generate(llm: LLM, lora: LoRARequest | None) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, lora_request=lora, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("executor,tp", [("uni", 1), pytest.param("mp", 2, marks=pytest.mark.slow)])
def test_lora_modules_are_read_at_start_up(tiny_llama, adapters, executor, tp):
    """Three modules, one device slot, two kept in host memory: every rank reads the
    first two at start (one in the slot), the third on first use; requests naming the
    first two start no read and get PEFT's tokens."""
    modules = [f"{name}={adapters[name]}" for name in ("a", "b", "c")]
    overrides = {"executor": executor, "tensor_parallel_size": tp}
    with LLM(**settings(tiny_llama, modules, max_loras=1, max_cpu_loras=2, **overrides)) as llm:
        states = llm.collective_rpc("lora_state")
        assert len(states) == tp
        for state in states:
            assert state["reads_started"] == 2
            assert sorted(state["host"]) == [1, 2] and state["host_bytes"] > 0
            assert state["slots"] == {"1": 0} and state["free_slots"] == 0
        base = str(tiny_llama)
        for lora_id, name in ((2, "b"), (1, "a")):
            lora = LoRARequest(name, lora_id, adapters[name])
            assert generate(llm, lora) == peft_tokens(base, adapters[name])
        for state in llm.collective_rpc("lora_state"):
            assert state["reads_started"] == 2  # no read
        # The third module is read when first asked for, under its id.
        assert generate(llm, LoRARequest("c", 3, adapters["c"])) == peft_tokens(base, adapters["c"])
        for state in llm.collective_rpc("lora_state"):
            assert state["reads_started"] == 3
        # An id of a module with another path would be served the module's weights.
        with pytest.raises(ValueError, match="lora_int_id 1 is the --lora-modules adapter 'a'"):
            generate(llm, LoRARequest("other", 1, adapters["b"]))


@pytest.mark.parametrize(
    "entry,words",
    [
        ("wide", ["'wide'", "r=16", "max_lora_rank=8", "--max-lora-rank"]),
        ("missing", ["'missing'", "adapter_config.json"]),
        ("broken", ["'broken'", "rank r=4", "could not be loaded"]),
    ],
)
def test_a_bad_lora_modules_entry_fails_llm_start_up(tiny_llama, adapters, tmp_path, entry, words):
    path = {
        "wide": adapters["wide"],
        "missing": str(tmp_path / "nowhere"),
        "broken": broken_adapter(adapters["a"], tmp_path / "broken"),
    }[entry]
    # One adapter kept in host memory: the first entry is read at start-up, the second
    # only checked (its weights read on first use); both fail start-up. The engine runs
    # in this process (the worker's start-up reads and checks are the same code): a
    # failure crossing the process boundary is the serve test's below.
    bad, good = f"{entry}={path}", f"a={adapters['a']}"
    modules = [good, bad] if entry == "wide" else [bad, good]
    with pytest.raises(Exception) as failure:
        LLM(**settings(tiny_llama, modules, multiprocessing=False))
    message = str(failure.value)
    assert "--lora-modules" in message and path in message, message
    for word in words:
        assert word in message, message


def test_a_bad_lora_modules_entry_fails_serve_start_up(tiny_llama, adapters, tmp_path):
    """``enginecore serve`` exits at start (no request sent) naming the adapter and its
    path: tensors the config does not describe are found by the start-up read."""
    broken = broken_adapter(adapters["a"], tmp_path / "broken")
    command = [sys.executable, "-m", "enginecore.cli", "serve", str(tiny_llama)]
    command += ["--port", str(free_port()), "--dtype", "float32", "--enable-lora"]
    command += ["--max-lora-rank", "8", "--num-blocks-override", "64"]
    command += ["--max-cpu-loras", "2", "--lora-modules", f"a={adapters['a']}", f"broken={broken}"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    assert "--lora-modules" in log and "'broken'" in log and broken in log, log
    assert "rank r=4" in log, log

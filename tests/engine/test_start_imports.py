"""What each process of a start imports. torch takes over a second to import and
transformers' model configs most of another; on 2 cores these were most of a warm start.
The frontend tokenizes without torch once a checkpoint's tokenizer class is known, a CPU
server's engine process (the ``mp`` executor) never imports torch, and a CPU start never
imports triton."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys

import psutil
import pytest

from tests.helpers.process_kinds import is_kind

LOAD_TOKENIZERS = """
import json, pathlib, sys
from enginecore.engine.tokenizer import checkpoint_tokenizer

for path in sys.argv[1:]:
    tokenizer = checkpoint_tokenizer(pathlib.Path(path))
    text = "Hello, world! Ünïcode and   spaces"
    ids = tokenizer(text)["input_ids"]
    chat = [{"role": "user", "content": text}]
    print(json.dumps({
        "torch": "torch" in sys.modules,
        "class": type(tokenizer).__name__,
        "ids": ids,
        "decoded": tokenizer.decode(ids, skip_special_tokens=True),
        "chat": tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
    }), flush=True)
"""


def _load_in_new_process(paths: list[pathlib.Path], cache: pathlib.Path) -> list[dict]:
    """Each checkpoint's tokenizer loaded, in order, by one new process: what it gave and
    whether torch was imported by then."""
    env = {**os.environ, "ENGINECORE_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", LOAD_TOKENIZERS, *map(str, paths)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()[-len(paths) :]]


ARCHS = ["llama", "qwen2", "gpt2"]


#: A copy of the Llama checkpoint whose tokenizer_config.json changes between the loads.
CHANGED = "changed"


@pytest.fixture(scope="module")
def tokenizer_cache(tmp_path_factory) -> pathlib.Path:
    """The cache the loads of ``tokenizer_loads`` share."""
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="module")
def tokenizer_loads(
    checkpoint_factory, tmp_path_factory, tokenizer_cache
) -> dict[str, tuple[dict, dict]]:
    """Arch (and ``CHANGED``) -> (first load, second load): one new process loads the
    three checkpoints' tokenizers and the copy's with an empty cache, then (the copy's
    tokenizer config changed) another with the cache the first one left. The copy is
    loaded last: a second load that imports torch shows in its own record (torch stays
    imported), and the three before it import none."""
    import shutil

    changed = tmp_path_factory.mktemp("changed-tokenizer") / "model"
    shutil.copytree(checkpoint_factory("llama"), changed)
    paths = [*(checkpoint_factory(arch) for arch in ARCHS), changed]
    cache = tokenizer_cache
    first = _load_in_new_process(paths, cache)
    assert len(list((cache / "tokenizer-classes").iterdir())) == len(paths)  # one each
    config_file = changed / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["model_max_length"] = 77
    config_file.write_text(json.dumps(config))
    second = _load_in_new_process(paths, cache)
    return {name: (f, s) for name, f, s in zip([*ARCHS, CHANGED], first, second, strict=True)}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_checkpoint_tokenizer_loads_without_torch_after_the_first_time(
    arch, checkpoint_factory, tokenizer_loads
):
    from transformers import AutoTokenizer

    path = checkpoint_factory(arch)
    first, second = tokenizer_loads[arch]
    # AutoTokenizer, which loads the model's config (and leaves a record: the fixture
    # counts one per checkpoint; torch stays imported for the loads after the first)
    assert first["torch"] is True
    assert second["torch"] is False
    reference = AutoTokenizer.from_pretrained(str(path))
    assert second["class"] == type(reference).__name__
    assert (
        second["ids"]
        == first["ids"]
        == reference("Hello, world! Ünïcode and   spaces")["input_ids"]
    )
    assert second["decoded"] == first["decoded"]
    assert second["chat"] == first["chat"]
    assert second["special"] == first["special"]


def test_a_changed_tokenizer_is_asked_of_autotokenizer_again(tokenizer_loads, tokenizer_cache):
    _, again = tokenizer_loads[CHANGED]
    assert again["torch"] is True  # a new record: the class was asked for again
    # one record per checkpoint, and the changed tokenizer's second
    assert len(list((tokenizer_cache / "tokenizer-classes").iterdir())) == len(ARCHS) + 2


def _descendants_running(kind: str) -> list[int]:
    """This process's descendants of ``kind`` (``engine`` or ``worker``)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # the process has gone
            if is_kind(child, kind):
                found.append(child.pid)
    return found


def _mapped_libraries(pid: int) -> str:
    return pathlib.Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture(scope="module")
def server_like_start(tiny_llama):
    """One engine started as a CPU server starts it (one core kept for the frontend, the
    executor chosen by auto), with work alongside its start that records the engine
    processes it sees: ``(llm, [what the work saw], the engine processes after the start)``.
    """
    from enginecore import LLM
    from enginecore.engine.client import alongside_engine_start

    seen: list[list[int]] = []
    with pytest.MonkeyPatch.context() as env:
        # The Triton tests' modules turn the interpreter on for the whole test process.
        env.delenv("TRITON_INTERPRET", raising=False)
        with alongside_engine_start(lambda: seen.append(_engine_processes())):
            llm = LLM(model=str(tiny_llama), cpu_reserved_cores=1, max_model_len=64, max_num_seqs=4)
    try:
        yield llm, seen, _engine_processes()
    finally:
        llm.shutdown()


@pytest.mark.skipif(not pathlib.Path("/proc/self/maps").exists(), reason="reads /proc")
def test_a_cpu_servers_engine_process_loads_neither_torch_nor_triton(server_like_start):
    """The engine process schedules; with the ``mp`` executor (what ``auto`` picks for a
    CPU server) the model runs in the worker, which loads torch but, on CPU, not triton."""
    import torch

    if torch.version.cuda or torch.version.hip:
        pytest.skip("a GPU build of torch: the engine process asks torch for a device")
    from enginecore import SamplingParams

    llm = server_like_start[0]
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    engines = _descendants_running("engine")
    workers = _descendants_running("worker")
    assert len(engines) == 1 and len(workers) == 1, (engines, workers)
    assert "libtorch" not in _mapped_libraries(engines[0])
    worker_maps = _mapped_libraries(workers[0])
    assert "libtorch" in worker_maps  # the check can see a library when it is there
    assert "libtriton" not in worker_maps


def test_the_torch_build_is_read_from_its_version_file(tmp_path, monkeypatch):
    from enginecore import distributed

    def build(**fields: str | None) -> None:
        package = tmp_path / "torch"
        package.mkdir(exist_ok=True)
        (package / "__init__.py").write_text("raise ImportError('not to be imported')\n")
        lines = [f"{name}: Optional[str] = {value!r}" for name, value in fields.items()]
        (package / "version.py").write_text("\n".join(["from typing import Optional", *lines]))

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    build(cuda=None, hip=None)
    assert distributed.torch_built_for_gpu() is False
    assert distributed.resolve_device_type("auto") == "cpu"
    build(cuda="12.8", hip=None)
    assert distributed.torch_built_for_gpu() is True
    build(cuda=None, hip="6.3")
    assert distributed.torch_built_for_gpu() is True
    build(cuda=None)  # a version file this does not know: torch is asked
    assert distributed.torch_built_for_gpu() is True


def _engine_processes() -> list[int]:
    return _descendants_running("engine")


def test_work_alongside_an_engine_start_runs_while_the_engine_process_boots(server_like_start):
    from enginecore.engine.client import alongside_engine_start

    _, seen, after_start = server_like_start
    assert len(seen) == 1 and len(seen[0]) == 1  # ran once, with the engine spawned
    assert after_start == seen[0]
    with alongside_engine_start(lambda: seen.append(_engine_processes())):
        pass
    assert len(seen) == 1  # only starts inside the block run it


def test_a_failure_alongside_an_engine_start_stops_the_engine(tiny_llama):
    import time

    from enginecore import LLM
    from enginecore.engine.client import alongside_engine_start

    def fail() -> None:
        raise RuntimeError("the app could not be imported")

    running = _engine_processes()  # another module fixture's engine, if it is up

    with (
        pytest.raises(RuntimeError, match="could not be imported"),
        alongside_engine_start(fail),
    ):
        LLM(model=str(tiny_llama), max_model_len=64, max_num_seqs=4)
    deadline = time.monotonic() + 30
    while _engine_processes() != running and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _engine_processes() == running


def test_the_server_launcher_leaves_the_http_stack_for_later():
    """``enginecore serve`` spawns the engine before importing FastAPI and the API's
    models, which it imports while the engine boots."""
    code = (
        "import sys, enginecore.server.launch as launch; "
        "print(sorted(m for m in ('fastapi', 'pydantic', 'torch', 'transformers', "
        "launch.APP_MODULE) if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_importing_the_offline_api_leaves_torch_transformers_and_http_for_later():
    """``from enginecore import LLM`` imports neither torch (the frontend tokenizes
    without it; the engine process imports it while the tokenizer loads) nor
    transformers nor the HTTP stack."""
    code = (
        "import sys; from enginecore import LLM, SamplingParams; "
        "print(sorted(m for m in ('fastapi', 'uvicorn', 'torch', 'transformers') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"

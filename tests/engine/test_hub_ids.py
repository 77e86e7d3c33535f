"""Hub ids as model names, as vLLM users type them: the Hugging Face cache first (tested
offline with a cache laid out as huggingface_hub lays it out), and one clear line when the
id is neither cached nor downloadable."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

REPO_ID = "testorg/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(tmp_path, checkpoint):
    """A Hugging Face cache holding ``REPO_ID`` at ``COMMIT`` (huggingface_hub's layout)."""
    repo = tmp_path / "hub" / ("models--" + REPO_ID.replace("/", "--"))
    shutil.copytree(checkpoint, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return tmp_path / "hub"


def _run(code: str, hub, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_a_cached_hub_id_is_served_under_its_id(tiny_llama, tmp_path):
    hub = _hub_cache(tmp_path, tiny_llama)
    code = (
        "import sys\n"
        "from enginecore import LLM, SamplingParams\n"
        # The engine in this process: the id is resolved before any engine starts.
        "with LLM(model=sys.argv[1], max_model_len=64, num_blocks_override=16,\n"
        "         multiprocessing=False) as llm:\n"
        "    print(llm.config.model.served_model_name)\n"
        "    print(llm.config.model.path)\n"
        "    out = llm.generate(['hi'], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)\n"
        "    print(len(out[0].outputs[0].token_ids))\n"
    )
    done = _run(code, hub, REPO_ID)
    assert done.returncode == 0, done.stderr
    name, path, generated = done.stdout.split()
    assert name == REPO_ID and path.endswith(f"snapshots/{COMMIT}") and generated == "2"


def test_an_id_neither_cached_nor_downloadable_is_one_line(tmp_path):
    hub = tmp_path / "empty-hub"
    hub.mkdir()
    done = _run(
        "from enginecore.cli import main; raise SystemExit(main())", hub, "serve", "nobody/nothing"
    )
    assert done.returncode == 2
    assert "model 'nobody/nothing' is not a path" in done.stderr
    assert "HF_HUB_OFFLINE is set" in done.stderr and "Traceback" not in done.stderr

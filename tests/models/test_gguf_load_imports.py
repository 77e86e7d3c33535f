"""A GGUF load reads its config without transformers' model stack: Llama's config is
built on the base config class (its transformers module imports ``torch.distributed``
and accelerate through one field validator), and equals ``LlamaConfig``'s. The runner's
entry point (``load_hf_config``) takes that path without importing ``AutoConfig``, whose
import scans every transformers model's package (about half a second of a warm load)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import transformers

from enginecore_models.weight_loader import gguf_hf_config
from tests.helpers.gguf_writer import write_gguf

pytest.importorskip("gguf")

HEAVY = (
    "transformers.activations",
    "transformers.models.auto",
    "torch.distributed.tensor",
    "accelerate",
)

READ_CONFIG = """
import json, sys
from enginecore_models.weight_loader import load_hf_config
config = load_hf_config(sys.argv[1])
print(json.dumps({"heavy": [m for m in sys.argv[2:] if m in sys.modules],
                  "architectures": config.architectures}))
"""


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, checkpoint_factory):
    return write_gguf(checkpoint_factory("llama"), tmp_path_factory.mktemp("gguf") / "l.gguf")


def test_a_llama_gguf_config_leaves_transformers_model_stack_unimported(llama_gguf):
    out = subprocess.run(
        [sys.executable, "-c", READ_CONFIG, str(llama_gguf), *HEAVY],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"heavy": [], "architectures": ["LlamaForCausalLM"]}


def test_a_llama_gguf_config_equals_transformers_llama_config(llama_gguf):
    config = gguf_hf_config(llama_gguf)
    fields = {k: v for k, v in config.to_dict().items() if k != "transformers_version"}
    reference = transformers.LlamaConfig(**fields)
    assert config.to_dict() == reference.to_dict()
    assert type(transformers.AutoConfig.for_model(**config.to_dict())) is transformers.LlamaConfig

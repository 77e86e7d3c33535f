"""llama.cpp's repacked weight layouts (its "extra buffer types": AMX and the CPU repack)
crash some builds with a segmentation fault while loading or at the first product. A
crash kills the process, so whether they work is tried in a child process first, and
where they do not, the weights load without them."""

from __future__ import annotations

import subprocess
import sys

import llama_cpp


def without_repacking() -> None:
    """Every ``Llama`` made after this call loads its weights in plain layouts."""
    default_params = llama_cpp.llama_model_default_params

    def params():
        chosen = default_params()
        chosen.use_extra_bufts = False
        return chosen

    llama_cpp.llama_model_default_params = params
    llama_cpp.llama.llama_cpp.llama_model_default_params = params


def repacking_works(path: str) -> bool:
    """Whether a child process can load ``path`` with repacking and decode two tokens."""
    probe = (
        "import sys; from llama_cpp import Llama; "
        "llm = Llama(sys.argv[1], n_ctx=64, verbose=False); "
        "list(zip(range(2), llm.generate([1, 2, 3], temp=0.0, top_k=1)))"
    )
    done = subprocess.run([sys.executable, "-c", probe, path], capture_output=True)
    return done.returncode == 0

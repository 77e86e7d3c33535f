"""llama.cpp through llama-cpp-python, on a GGUF file: one sequence at a time (the
binding decodes a single sequence), greedy, exactly ``output_len`` tokens each (its
``generate`` never stops by itself). A batch of B prompts is B sequences in a row.

    $PEERS/llamacpp-venv/bin/python run_llamacpp.py SPEC.json RESULT.json   (see harness.py)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import main


def load(spec):
    import llama_cpp
    from llamacpp_repack import repacking_works, without_repacking

    if not spec.get("gguf"):
        raise SystemExit("llamacpp needs a GGUF file: pass --gguf to enginecore bench compare")
    if not repacking_works(spec["gguf"]):
        print("llama.cpp: its repacked weight layouts crash here; loading without them")
        without_repacking()
    llm = llama_cpp.Llama(
        model_path=spec["gguf"],
        n_ctx=spec["max_model_len"],
        n_batch=512,
        n_threads=spec.get("threads") or os.cpu_count(),
        seed=0,
        verbose=False,
    )

    def generate(prompts, output_len):
        produced = 0
        for prompt in prompts:
            llm.reset()
            for n, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), 1):
                if n == output_len:
                    break
            produced += n
        return produced

    return llama_cpp.__version__, generate, llm.close


if __name__ == "__main__":
    main(load)

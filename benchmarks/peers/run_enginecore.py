"""enginecore's offline ``LLM.generate``: greedy, ``ignore_eos``; the prefix cache is
reset before every batch so every repetition computes every prompt.

    python run_enginecore.py SPEC.json RESULT.json   (see harness.py)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import main


def load(spec):
    import enginecore
    from enginecore import LLM, SamplingParams

    llm = LLM(
        spec["model"],
        dtype=spec["dtype"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=max(spec["batch_sizes"]),
    )

    def generate(prompts, output_len):
        llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    return enginecore.__version__, generate, llm.shutdown


if __name__ == "__main__":
    main(load)

"""transformers ``generate``: each batch is one static batch (all prompts have the same
length, so no padding), greedy, exactly ``output_len`` new tokens (no EOS stop).

    PYTHON run_transformers.py SPEC.json RESULT.json   (see harness.py)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import main


def load(spec):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()
    pad = model.generation_config.pad_token_id or 0

    def generate(prompts, output_len):
        ids = torch.tensor(prompts, dtype=torch.long)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
        return int(out[:, ids.shape[1] :].numel())

    return transformers.__version__, generate, lambda: None


if __name__ == "__main__":
    main(load)

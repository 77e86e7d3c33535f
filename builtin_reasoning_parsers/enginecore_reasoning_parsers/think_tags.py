"""The think-block formats: Qwen3, DeepSeek-R1 and Mistral's Magistral.

- Qwen3 writes ``<think>...</think>`` then the answer. With ``enable_thinking: false``
  its chat template closes an empty block in the prompt, and the output is all answer;
  the Thinking-2507 templates open the block in the prompt, and the output starts inside
  it. Output with no block at all is the answer.
- DeepSeek-R1 writes the same block, but its template opens it in the prompt and the
  model often omits the opening marker: text before ``</think>`` is reasoning even without
  one, and an output with no end marker is all reasoning (cut short while thinking).
- Magistral writes ``[THINK]...[/THINK]`` (special tokens in its tokenizer) then the
  answer; output with no block is the answer.
"""

from __future__ import annotations

from enginecore.reasoning_parsers import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    untagged_is_reasoning = False


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    untagged_is_reasoning = True


class MistralReasoningParser(ThinkTagReasoningParser):
    keeps_special_tokens = True  # [THINK] and [/THINK] are control tokens
    start_markers = ("[THINK]",)
    end_markers = ("[/THINK]",)
    untagged_is_reasoning = False

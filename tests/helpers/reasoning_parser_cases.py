"""Each built-in reasoning parser's family output, with the reasoning and content it must yield."""

from __future__ import annotations

from enginecore_reasoning_parsers.granite import GraniteReasoningParser
from enginecore_reasoning_parsers.think_tags import (
    DeepSeekR1ReasoningParser,
    MistralReasoningParser,
    Qwen3ReasoningParser,
)

# (parser, prompt tail, model output, expected reasoning, expected content)
QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


QWEN3_NO_THINKING = QWEN3_PROMPT + "<think>\n\n</think>\n\n"


R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"  # noqa: RUF001 - DeepSeek's own characters


CASES = {
    "qwen3 think block": (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        "<think>\nThe user greets me.\n</think>\n\nHello!",
        "\nThe user greets me.\n",
        "\n\nHello!",
    ),
    "qwen3 thinking disabled by the template": (
        Qwen3ReasoningParser,
        QWEN3_NO_THINKING,
        "Hello! </think> is just text here.",
        None,
        "Hello! </think> is just text here.",
    ),
    "qwen3 no block at all": (Qwen3ReasoningParser, QWEN3_PROMPT, "Hello!", None, "Hello!"),
    "qwen3 block opened by the template (Thinking-2507)": (
        Qwen3ReasoningParser,
        QWEN3_PROMPT + "<think>\n",
        "Greeting.\n</think>\n\nHello!",
        "Greeting.\n",
        "\n\nHello!",
    ),
    "qwen3 cut short while thinking": (
        Qwen3ReasoningParser,
        QWEN3_PROMPT,
        "<think>\nLet me think about",
        "\nLet me think about",
        None,
    ),
    "deepseek_r1 opening tag in the prompt": (
        DeepSeekR1ReasoningParser,
        R1_PROMPT,
        "Okay, a greeting.\n</think>\n\nHello!",
        "Okay, a greeting.\n",
        "\n\nHello!",
    ),
    "deepseek_r1 missing opening tag, generic prompt": (
        DeepSeekR1ReasoningParser,
        "User: Hi\nAssistant:",
        "Okay, a greeting.</think>Hello!",
        "Okay, a greeting.",
        "Hello!",
    ),
    "deepseek_r1 with its own opening tag": (
        DeepSeekR1ReasoningParser,
        "User: Hi\nAssistant:",
        "<think>Hmm.</think>Hello!",
        "Hmm.",
        "Hello!",
    ),
    "deepseek_r1 cut short": (DeepSeekR1ReasoningParser, R1_PROMPT, "Okay, so", "Okay, so", None),
    "deepseek_r1 thinking disabled": (
        DeepSeekR1ReasoningParser,
        "<｜Assistant｜></think>",  # noqa: RUF001
        "Hello!",
        None,
        "Hello!",
    ),
    "mistral (Magistral)": (
        MistralReasoningParser,
        "[INST]Hi[/INST]",
        "[THINK]A greeting.[/THINK]Hello!",
        "A greeting.",
        "Hello!",
    ),
    "mistral without thinking": (
        MistralReasoningParser,
        "[INST]Hi[/INST]",
        "Hello!",
        None,
        "Hello!",
    ),
    "granite": (
        GraniteReasoningParser,
        "<|start_of_role|>assistant<|end_of_role|>",
        "Here is my thought process:\nA greeting.\nHere is my response:\nHello!",
        "\nA greeting.\n",
        "\nHello!",
    ),
    "granite contracted markers": (
        GraniteReasoningParser,
        "",
        "Here's my thought process: greet back. Here's my response: Hello!",
        " greet back. ",
        " Hello!",
    ),
    "granite without thinking": (GraniteReasoningParser, "", "Hello!", None, "Hello!"),
}

"""Each built-in tool-call parser's family output, with the calls it must yield."""

from __future__ import annotations

from enginecore_tool_parsers.llama3_json import Llama3JsonToolParser
from enginecore_tool_parsers.mistral import MistralToolParser
from enginecore_tool_parsers.pythonic import PythonicToolParser
from enginecore_tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "scale": {"type": "number"},
                    "hours": {"type": "array"},
                    "zip": {"type": "string"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": None}},
]


WEATHER = ("get_weather", {"city": "San Francisco", "days": 3})


TIME = ("get_time", {})


# (parser, model output, expected content, expected calls)
CASES = {
    "llama3_json": (
        Llama3JsonToolParser,
        '{"name": "get_weather", "parameters": {"city": "San Francisco", "days": 3}}',
        None,
        [WEATHER],
    ),
    "llama3_json python_tag, two calls": (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco", '
        '"days": 3}}; {"name": "get_time", "parameters": {}}',
        None,
        [WEATHER, TIME],
    ),
    "llama3_json arguments key": (
        Llama3JsonToolParser,
        '{"name":"get_time","arguments":{}}',
        None,
        [TIME],
    ),
    "mistral v3 list": (
        MistralToolParser,
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "San Francisco", '
        '"days": 3}}, {"name": "get_time", "arguments": {}}]',
        None,
        [WEATHER, TIME],
    ),
    "mistral v3 after text": (
        MistralToolParser,
        'Let me look.[TOOL_CALLS][{"name":"get_time","arguments":{}}]',
        "Let me look.",
        [TIME],
    ),
    "mistral v11": (
        MistralToolParser,
        '[TOOL_CALLS]get_weather[ARGS]{"city": "San Francisco", "days": 3}'
        "[TOOL_CALLS]get_time[ARGS]{}",
        None,
        [WEATHER, TIME],
    ),
    "pythonic": (
        PythonicToolParser,
        "[get_weather(city='San Francisco', days=3), get_time()]",
        None,
        [WEATHER, TIME],
    ),
    "pythonic llama4 tokens and literals": (
        PythonicToolParser,
        '<|python_start|>[get_weather(city="San Francisco", days=3, metric=True, '
        "hours=[1, 2], zip=None)]<|python_end|>",
        None,
        [
            (
                "get_weather",
                {"city": "San Francisco", "days": 3, "metric": True, "hours": [1, 2], "zip": None},
            )
        ],
    ),
    "qwen3_coder": (
        Qwen3CoderToolParser,
        "I will check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        "I will check.\n",
        [WEATHER, TIME],
    ),
    "qwen3_coder typed values": (
        Qwen3CoderToolParser,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=metric>\nfalse\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
        "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=days>\nsoon\n</parameter>\n"
        "</function>\n</tool_call>",
        None,
        [
            (
                "get_weather",
                {"city": "42", "metric": False, "scale": 1.5, "hours": [1, 2], "days": "soon"},
            )
        ],
    ),
}

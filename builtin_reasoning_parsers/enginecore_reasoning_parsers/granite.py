"""IBM Granite 3.2's reasoning format (``chat_template_kwargs: {"thinking": true}``).

The model writes ``Here is my thought process:`` (or ``Here's my thought process:``), its
reasoning, then ``Here is my response:`` (or ``Here's my response:``) and the answer.
Output that does not open with the thought-process marker is all answer.
"""

from __future__ import annotations

from enginecore.reasoning_parsers import ThinkTagReasoningParser


class GraniteReasoningParser(ThinkTagReasoningParser):
    start_markers = ("Here is my thought process:", "Here's my thought process:")
    end_markers = ("Here is my response:", "Here's my response:")
    untagged_is_reasoning = False

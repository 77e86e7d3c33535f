"""A conversation rendered to prompt token ids by a chat template: the one path that
``LLM.chat``, ``AsyncLLM.chat_prompt`` and so every chat route of the server take."""

from __future__ import annotations

from typing import Any

from enginecore.errors import InvalidRequestError

Message = dict[str, Any]


def render_chat(
    tokenizer: Any,
    messages: list[Message],
    *,
    chat_template: str | None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of ``messages`` under ``chat_template`` (None: the tokenizer's own);
    ``continue_final_message`` leaves the last message open for the reply to continue.
    A template that is missing or raises is the request's error (InvalidRequestError)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(
            "this model's tokenizer has no chat template; pass one (chat_template=...)"
        )
    try:
        token_ids = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            **(chat_template_kwargs or {}),
        )
    except Exception as exc:
        raise InvalidRequestError(f"could not apply the chat template: {exc}") from exc
    if not isinstance(token_ids, list):  # transformers 5 returns a BatchEncoding
        token_ids = list(token_ids["input_ids"])
    return token_ids

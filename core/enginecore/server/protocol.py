"""OpenAI request bodies (pydantic, for the HTTP layer only) and the server's own endpoints'.

A field this server does not know is a 400 naming it (a request written for a vLLM feature
we lack must not succeed without it), unless ``server.unknown_request_fields`` is ``warn``;
a field of the wrong type is a 400 too. Fields after
the OpenAI ones are vLLM's and enginecore's extensions.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from enginecore.server.unknown_fields import drop_unknown


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _StrictBody(BaseModel):
    """A request body whose unknown fields are refused (400 naming each one), or, with
    ``server.unknown_request_fields = "warn"``, logged and ignored."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        return drop_unknown(cls, data)


class StreamOptions(_StrictBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM: every chunk carries the running ``usage``."""
    min_characters: int | None = Field(default=None, ge=0)
    """vLLM: hold streamed text back until at least this many characters are pending (the
    last chunk of each choice sends whatever is left)."""


class StructuredOutputs(_StrictBody):
    """vLLM's ``structured_outputs`` request field (formerly the ``guided_*`` fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None


class JSONSchemaFormat(_Body):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI ``response_format``: ``text``, ``json_object`` or ``json_schema``; vLLM's
    ``structural_tag`` (with ``structures`` and ``triggers``, or xgrammar's ``format``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None
    """``structural_tag`` in xgrammar's own form (instead of ``structures``/``triggers``)."""


class SamplingFields(_StrictBody):
    """Fields completions and chat share."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # --- enginecore extensions ---
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    priority: int = 0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    metadata: dict[str, Any] | None = None
    """User metadata; stat loggers see it as ``extra`` (with ``user`` added)."""
    kv_transfer_params: dict[str, Any] | None = None
    """KV connector handle (disaggregated prefill/decode): a prefill response's
    ``kv_transfer_params``, passed on to the decode instance (see docs/kv_transfer.md)."""
    data_parallel_rank: int | None = None
    """The data-parallel replica to run on (external load balancing)."""
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extras (pass them with the openai client's ``extra_body``).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's other extensions.
    return_token_ids: bool = False
    """The prompt's and each choice's token ids in the response (``prompt_token_ids``,
    ``token_ids``)."""
    return_tokens_as_token_ids: bool = False
    """Logprob tokens as ``"token_id:N"`` (for tokens that are not valid text alone)."""
    logprob_token_ids: list[int] | None = None
    """vLLM: the logprobs of exactly these token ids at each generated position, instead
    of the top ``logprobs``/``top_logprobs`` (which must still be set); at most 128."""
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """Keep only N of the prompt's tokens (-1: as many as ``max_model_len`` allows)."""
    truncation_side: Literal["left", "right"] | None = None
    """Which end ``truncate_prompt_tokens`` cuts: ``left`` (the default) keeps the last N
    tokens, ``right`` the first N (vLLM's field)."""
    use_beam_search: bool = False
    """Beam search instead of sampling: ``n`` (completions: ``best_of`` when larger) is
    the beam width, the best ``n`` beams are the choices."""
    length_penalty: float = 1.0
    """Beam search: beams are ranked by ``cum_logprob / length ** length_penalty``."""
    early_stopping: bool = False
    """Beam search: stop once ``beam width`` beams have finished (else run to
    ``max_tokens``)."""


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    """Sample this many candidates and return the ``n`` with the highest cumulative
    logprob (not with streaming, where it must equal ``n``)."""
    suffix: str | None = None
    """Refused when given: no model served here fills in the middle."""
    # --- enginecore extensions ---
    prompt_logprobs: int | None = None
    """Top-N logprobs of each prompt token (vLLM extension; returned as each choice's
    ``prompt_logprobs``); ``echo`` with ``logprobs``
    implies ``prompt_logprobs = logprobs``."""


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # --- enginecore extensions ---
    prompt_logprobs: int | None = None
    """Top-N logprobs of each prompt token (vLLM extension), in the response's top-level
    ``prompt_logprobs``."""
    echo: bool = False
    """Like vLLM: prefix the reply with the last message's content when that message has
    the reply's role (``assistant``): a continued partial assistant turn."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """Render the last (assistant) message as an open turn the reply continues (vLLM);
    cannot be combined with ``add_generation_prompt``."""
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    """With a reasoning parser: send the thinking (``reasoning_content``); false drops it,
    leaving only the answer (vLLM)."""


class ResponsesRequest(_StrictBody):
    """OpenAI's Responses API (``POST /v1/responses``), text in and text out."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    """Keep the response (bounded, oldest dropped first) for ``previous_response_id`` and
    ``GET /v1/responses/{id}``."""
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    """Only ``{"format": {"type": "text"}}``."""
    truncation: Literal["disabled"] | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: Literal["none", "auto"] | None = None
    service_tier: str | None = None
    # Accepted only empty or false: each names what this server does not do.
    tools: list[dict[str, Any]] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: int | None = None


class TokenizeRequest(_StrictBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    """Passed to the chat template with ``messages``, as in a chat request."""
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    """Each token's string as the tokenizer spells it, in ``token_strs`` (vLLM's field)."""


class DetokenizeRequest(_StrictBody):
    model: str | None = None
    tokens: list[int]


#: The longest wait a /collective_rpc client may ask for (one day).
COLLECTIVE_RPC_MAX_TIMEOUT_S = 86400.0


class CollectiveRPCRequest(_Body):
    method: str
    """The name of a worker method or a registered worker RPC (never code)."""
    args: list[Any] = []
    kwargs: dict[str, Any] | None = None
    timeout: float | None = Field(default=None, gt=0, le=COLLECTIVE_RPC_MAX_TIMEOUT_S)
    """Seconds to wait for every rank: bounded, since a huge value overflows the wait."""


PauseMode = Literal["abort", "wait", "keep"]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """The OpenAI ``usage`` object; ``prompt_tokens_details.cached_tokens`` counts the prompt
    tokens served from the prefix cache (or a KV transfer) rather than computed."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }

"""Engine logprobs (one ``{token_id: Logprob}`` per sampled token) in OpenAI's two shapes."""

from __future__ import annotations

from typing import Any

from enginecore.engine.output import Logprob

#: What a ``-inf`` logprob (a token a grammar or a bias ruled out) is sent as: JSON has no
#: infinity, and vLLM's clients expect this floor.
LOGPROB_FLOOR = -9999.0


def _value(lp: Logprob) -> float:
    return max(lp.logprob, LOGPROB_FLOOR)


def _token(token_id: int, lp: Logprob, tokenizer: Any, as_ids: bool = False) -> str:
    """The token as text; ``as_ids`` (vLLM's ``return_tokens_as_token_ids``): ``token_id:N``."""
    if as_ids:
        return f"token_id:{token_id}"
    if lp.decoded_token is not None:
        return lp.decoded_token
    text: str = tokenizer.decode([token_id])
    return text


def _sampled_and_top(
    entry: dict[int, Logprob], num_top: int, listed: list[int] | None = None
) -> tuple[tuple[Any, ...], list[Any]]:
    # The engine lists the sampled token first, then the top-N by rank. With ids listed
    # in ``logprob_token_ids``, vLLM shows every entry: the sampled token, then the ids in
    # the request's order.
    items = list(entry.items())
    sampled = items[0]
    if listed:
        rest = [(t, entry[t]) for t in dict.fromkeys(listed) if t in entry and t != sampled[0]]
        return sampled, [sampled, *rest]
    top = sorted(items, key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
    return sampled, top[:num_top]


def completion_logprobs(
    entries: list[dict[int, Logprob]],
    num_top: int,
    tokenizer: Any,
    text_offset: int = 0,
    as_ids: bool = False,
    listed: list[int] | None = None,
) -> dict[str, Any]:
    """The ``/v1/completions`` shape: parallel lists, ``top_logprobs`` as dicts. Like
    OpenAI's, each ``top_logprobs`` dict holds the sampled token too when it is not among
    the top N (N + 1 entries then); with ``listed`` ids, those instead of the top N."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        if not entry:
            continue
        (token_id, lp), top = _sampled_and_top(entry, num_top, listed)
        text = _token(token_id, lp, tokenizer, as_ids)
        tokens.append(text)
        token_logprobs.append(_value(lp))
        shown = top if any(t == token_id for t, _ in top) else [*top, (token_id, lp)]
        top_logprobs.append({_token(t, p, tokenizer, as_ids): _value(p) for t, p in shown})
        offsets.append(offset)
        offset += len(_token(token_id, lp, tokenizer))  # offsets count the text
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def echoed_prompt_logprobs(
    prompt_token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    num_top: int,
    tokenizer: Any,
    as_ids: bool = False,
) -> dict[str, Any]:
    """The prompt part of ``/v1/completions`` logprobs with ``echo``: the first token has
    ``null`` logprob and ``null`` top_logprobs (nothing precedes it), like OpenAI/vLLM."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(prompt_token_ids, entries, strict=True):
        if entry is None:
            text, value, top = tokenizer.decode([token_id]), None, None
            shown_text = f"token_id:{token_id}" if as_ids else text
        else:
            lp = entry[token_id]
            text, value = _token(token_id, lp, tokenizer), _value(lp)
            shown_text = _token(token_id, lp, tokenizer, as_ids)
            _, ranked = _sampled_and_top(entry, num_top)
            if not any(t == token_id for t, _ in ranked):
                ranked = [*ranked, (token_id, lp)]
            top = {_token(t, p, tokenizer, as_ids): _value(p) for t, p in ranked}
        tokens.append(shown_text)
        token_logprobs.append(value)
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def raw_prompt_logprobs(entries: list[dict[int, Logprob] | None]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` choice field: per prompt token ``None`` (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}``."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _value(lp), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


def concat_logprobs(first: dict[str, Any], second: dict[str, Any] | None) -> dict[str, Any]:
    """Two ``/v1/completions`` logprobs objects one after the other."""
    if second is None:
        return first
    return {key: first[key] + second[key] for key in first}


def _chat_item(token_id: int, lp: Logprob, tokenizer: Any, as_ids: bool) -> dict[str, Any]:
    text = _token(token_id, lp, tokenizer, as_ids)
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(
    entries: list[dict[int, Logprob]],
    num_top: int,
    tokenizer: Any,
    as_ids: bool = False,
    listed: list[int] | None = None,
) -> dict[str, Any]:
    """The ``/v1/chat/completions`` shape: ``{"content": [{token, logprob, bytes,
    top_logprobs}]}``; with ``listed`` ids (``logprob_token_ids``), ``top_logprobs`` holds
    the sampled token and those ids, in the request's order (vLLM's)."""
    content = []
    for entry in entries:
        if not entry:
            continue
        (token_id, lp), top = _sampled_and_top(entry, num_top, listed)
        item = _chat_item(token_id, lp, tokenizer, as_ids)
        item["top_logprobs"] = [_chat_item(t, p, tokenizer, as_ids) for t, p in top]
        content.append(item)
    return {"content": content}

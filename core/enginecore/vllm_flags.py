"""vLLM's spellings of command-line flags, read as ours: a `vllm serve` command line either
works here or is refused naming our equivalent, never answered with a bare
"unrecognized arguments". Every flag vLLM and enginecore spell alike needs nothing here;
docs/vllm_migration.md lists them all."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence

from enginecore.errors import ConfigError

logger = logging.getLogger("enginecore.cli")

#: vLLM flag -> our flags, for flags that take no value.
SWITCHES: dict[str, list[str]] = {
    "--enable-prefix-caching": ["--prefix-caching"],
    "--no-enable-prefix-caching": ["--no-prefix-caching"],
    "--enable-chunked-prefill": ["--chunked-prefill"],
    "--no-enable-chunked-prefill": ["--no-chunked-prefill"],
    "--disable-log-requests": ["--no-log-requests"],
    "--enable-log-requests": ["--log-requests"],
    # vLLM's switch turns every stat logger off; the server keeps /metrics here.
    "--disable-log-stats": ["--stat-loggers", ""],
}

#: vLLM switches that change nothing here, with why (logged once at start-up).
ACCEPTED_AS_IS: dict[str, str] = {
    "--trust-remote-code": (
        "enginecore never runs a checkpoint's own Python code: the architectures it "
        "supports (enginecore models) load without it"
    ),
    "--enable-prompt-tokens-details": (
        "usage.prompt_tokens_details.cached_tokens is always sent here"
    ),
}


def _executor(value: str) -> list[str]:
    return ["--executor", value]


def _structured_output_backend(value: str) -> list[str]:
    # vLLM's "auto" picks among its backends; the built-in one here is xgrammar.
    return ["--structured-output-backend", "xgrammar" if value == "auto" else value]


def _kv_cache_dtype(value: str) -> list[str]:
    if value == "auto":
        return []
    raise ConfigError(
        f"--kv-cache-dtype {value}: the KV cache is kept in the model's dtype here (choose "
        "it with --dtype); only 'auto' is accepted"
    )


def _speculative_config(value: str) -> list[str]:
    try:
        spec = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"--speculative-config is not valid JSON ({exc}): {value!r}") from None
    if not isinstance(spec, dict):
        raise ConfigError("--speculative-config takes a JSON object")
    if spec.get("model") is not None:
        raise ConfigError(
            "--speculative-config with a draft 'model': speculative decoding with a draft "
            'model is not supported; use {"method": "ngram", ...} (--speculative-method '
            "ngram) or a proposer plugin"
        )
    known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ConfigError(
            f"--speculative-config: {', '.join(unknown)} not supported here; the keys read "
            f"are {', '.join(sorted(known))}"
        )
    flags: list[str] = []
    for key, flag in (
        ("method", "--speculative-method"),
        ("num_speculative_tokens", "--num-speculative-tokens"),
        ("prompt_lookup_max", "--ngram-prompt-lookup-max"),
        ("prompt_lookup_min", "--ngram-prompt-lookup-min"),
    ):
        if key in spec:
            flags += [flag, str(spec[key])]
    return flags


#: vLLM flag -> its translation, for flags that take one value.
WITH_VALUE: dict[str, Callable[[str], list[str]]] = {
    "--distributed-executor-backend": _executor,
    "--guided-decoding-backend": _structured_output_backend,
    "--kv-cache-dtype": _kv_cache_dtype,
    "--speculative-config": _speculative_config,
}


def _served_model_names(values: list[str]) -> list[str]:
    if len(values) > 1:
        raise ConfigError(
            f"--served-model-name {' '.join(values)}: enginecore serves one name; give one "
            f"(vLLM reports the first, --served-model-name {values[0]})"
        )
    return ["--served-model-name", *values]


def translate(argv: Sequence[str]) -> list[str]:
    """``argv`` with vLLM's spellings replaced by ours; a spelling with no equivalent here
    raises :class:`ConfigError` naming what to use instead."""
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if arg in SWITCHES:
            out += SWITCHES[arg]
        elif arg in ACCEPTED_AS_IS:
            logger.warning("%s: accepted and ignored: %s", arg, ACCEPTED_AS_IS[arg])
        elif name in WITH_VALUE:
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise ConfigError(f"{name} needs a value")
            out += WITH_VALUE[name](value)
        elif name == "--served-model-name" and not eq:
            values = []
            while i + 1 < len(args) and not args[i + 1].startswith("-"):
                i += 1
                values.append(args[i])
            out += _served_model_names(values)
        else:
            out.append(arg)
        i += 1
    return out

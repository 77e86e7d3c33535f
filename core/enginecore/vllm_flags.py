"""vLLM's spellings of command-line flags, read as ours: a `vllm serve` command line either
works here or is refused naming our equivalent, never answered with a bare
"unrecognized arguments". Every flag vLLM and enginecore spell alike needs nothing here;
docs/vllm_migration.md lists them all."""

from __future__ import annotations

import functools
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
    "--enable-tokenizer-info-endpoint": "GET /tokenizer_info is always served here",
    "--disable-uvicorn-access-log": "the access log is off unless --log-requests",
}

#: vLLM value flags spelled otherwise here (the value passes unchanged).
RENAMED: dict[str, str] = {
    "-tp": "--tensor-parallel-size",
    "-pp": "--pipeline-parallel-size",
    "-dp": "--data-parallel-size",
    "--data-parallel-address": "--data-parallel-host",
    "--kv-cache-memory-bytes": "--kv-cache-bytes",
    "--num-gpu-blocks-override": "--num-blocks-override",
}

#: vLLM flags with no equivalent here -> what to use instead.
REFUSED: dict[str, str] = {
    "--scheduler-cls": (
        "schedulers are plugins chosen by name here: --scheduler-name NAME (a plugin's "
        "register_schedulers hook adds one)"
    ),
    "--worker-cls": (
        "the worker is the executor plugin's (--executor NAME); methods to call on workers "
        "are worker RPC plugins (register_worker_rpcs)"
    ),
    "--worker-extension-cls": (
        "methods to call on workers are worker RPC plugins here (register_worker_rpcs), "
        "called with collective_rpc or enginecore rpc"
    ),
    "--logits-processors": "custom logits processors are not supported",
    "--headless": "engines without an API server are not supported; see --data-parallel-size",
}


def _executor(value: str) -> list[str]:
    return ["--executor", value]


def _structured_output_backend(value: str) -> list[str]:
    # vLLM's "auto" picks among its backends; the built-in one here is xgrammar.
    return ["--structured-output-backend", "xgrammar" if value == "auto" else value]


def _structured_outputs_config(value: str) -> list[str]:
    """vLLM's ``--structured-outputs-config '{"backend": ..., "disable_any_whitespace": ...}'``
    (the successor of ``--guided-decoding-backend``)."""
    spec = _json_object("--structured-outputs-config", value)
    unknown = sorted(set(spec) - {"backend", "disable_any_whitespace"})
    if unknown:
        raise ConfigError(
            f"--structured-outputs-config: {', '.join(unknown)} not supported here; the keys "
            "read are backend (--structured-output-backend) and disable_any_whitespace "
            "(--disable-any-whitespace)"
        )
    flags = _structured_output_backend(str(spec["backend"])) if "backend" in spec else []
    if spec.get("disable_any_whitespace"):
        flags.append("--disable-any-whitespace")
    return flags


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _kv_cache_dtype(value: str) -> list[str]:
    """vLLM's ``auto`` and ``bfloat16`` (and ``float16``, ``float32``) pass; its fp8
    kinds have no kernel here."""
    if value in KV_CACHE_DTYPES:
        return ["--kv-cache-dtype", value]
    raise ConfigError(
        f"--kv-cache-dtype {value}: the KV cache is kept in one of "
        f"{', '.join(KV_CACHE_DTYPES)} here (auto: the model's dtype, float16 for a GGUF "
        "file on CPU; float16 or bfloat16 halve a float32 model's K/V bytes)"
    )


def _renamed(ours: str, value: str) -> list[str]:
    return [ours, value]


def _runner(value: str) -> list[str]:
    """vLLM's ``--runner auto|generate|pooling``; any other value names a runner plugin."""
    if value == "auto":
        return []
    return ["--runner", "torch" if value == "generate" else value]


def _max_model_len(value: str) -> list[str]:
    """vLLM's forms: an int, ``32k`` / ``1m`` (powers of 1024 for ``K``/``M``, of 1000 for
    ``k``/``m``), or ``auto`` / ``-1`` (the longest the memory holds: unset here)."""
    if value in ("auto", "-1"):
        return []
    scale = {"k": 1000, "m": 1000**2, "K": 1024, "M": 1024**2}
    number, unit = (value[:-1], value[-1]) if value and value[-1] in scale else (value, "")
    try:
        tokens = int(float(number) * scale.get(unit, 1))
    except ValueError:
        raise ConfigError(
            f"--max-model-len {value!r}: give a number of tokens (2048, 32k, 32K) or auto"
        ) from None
    return ["--max-model-len", str(tokens)]


def _kv_transfer_config(value: str) -> list[str]:
    spec = _json_object("--kv-transfer-config", value)
    flags: list[str] = []
    for key, flag in (("kv_connector", "--kv-connector"), ("kv_role", "--kv-role")):
        if key in spec:
            flags += [flag, str(spec.pop(key))]
    if "kv_connector_extra_config" in spec:
        extra = spec.pop("kv_connector_extra_config")
        flags += ["--kv-connector-extra-config", json.dumps(extra)]
    if spec:
        raise ConfigError(
            f"--kv-transfer-config: {', '.join(sorted(spec))} not supported here; the keys "
            "read are kv_connector, kv_role and kv_connector_extra_config"
        )
    return flags


def _json_object(flag: str, value: str) -> dict[str, object]:
    try:
        spec = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not valid JSON ({exc}): {value!r}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{flag} takes a JSON object")
    return spec


def _speculative_config(value: str) -> list[str]:
    spec = _json_object("--speculative-config", value)
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
    "--structured-outputs-config": _structured_outputs_config,
    "--kv-cache-dtype": _kv_cache_dtype,
    "--speculative-config": _speculative_config,
    "--max-model-len": _max_model_len,
    "--runner": _runner,
    "--kv-transfer-config": _kv_transfer_config,
    **{flag: functools.partial(_renamed, ours) for flag, ours in RENAMED.items()},
}


def _served_model_names(values: list[str]) -> list[str]:
    """vLLM's several names: the first is the one reported, the others are aliases."""
    if not values:
        raise ConfigError("--served-model-name needs a value")
    aliases = values[1:]
    bad = [a for a in aliases if "," in a or a == values[0]]
    if bad:
        raise ConfigError(
            f"--served-model-name {' '.join(values)}: a further name may not repeat the "
            f"first or hold a comma ({', '.join(map(repr, bad))})"
        )
    out = ["--served-model-name", values[0]]
    return out + (["--served-model-aliases", ",".join(aliases)] if aliases else [])


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
        elif name in REFUSED:
            raise ConfigError(f"{name} (vLLM's) has no equivalent here: {REFUSED[name]}")
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

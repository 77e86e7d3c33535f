"""The ``enginecore`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import typing
from collections.abc import Sequence
from typing import get_args

from enginecore.config import EngineConfig, add_config_flags, config_from_args
from enginecore.errors import EngineCoreError
from enginecore.registry import did_you_mean
from enginecore.vllm_flags import translate as translate_vllm_flags


class _Parser(argparse.ArgumentParser):
    """No abbreviated flags (``--max-num-s 32`` is an error, not ``--max-num-seqs``), and an
    unknown flag gets the closest known ones."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _all_flags(self) -> list[str]:
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags += sub._all_flags() if isinstance(sub, _Parser) else []
        return flags

    def error(self, message: str) -> typing.NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            flags = sorted(set(self._all_flags()))
            hints = [
                f"{arg}:{did_you_mean(arg.partition('=')[0], flags) or ' no such flag.'}"
                for arg in message.removeprefix(prefix).split()
                if arg.startswith("--")
            ]
            if hints:
                message += " (" + " ".join(hints) + ")"
        super().error(message)


def _add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool) -> None:
    _add_log_level(parser)
    if model_positional:
        parser.add_argument(
            "model_path", nargs="?", metavar="MODEL", help="checkpoint dir or .gguf"
        )
    parser.add_argument("--config", metavar="FILE", help="TOML, YAML or JSON config file")
    add_config_flags(parser)


def _resolve_config(args: argparse.Namespace) -> EngineConfig:
    if getattr(args, "model_path", None):
        args.model = args.model_path
    return config_from_args(args)


# --- models -------------------------------------------------------------------------


def cmd_models(args: argparse.Namespace) -> int:
    from enginecore.model_listing import model_rows, render_markdown, render_text
    from enginecore.plugins import make_plugin_manager

    # --markdown writes docs/models.md: the built-ins only, whatever is installed.
    host = make_plugin_manager(load_entrypoints=not args.markdown)
    rows = model_rows(host)
    if args.json:
        print(json.dumps(rows, indent=2))
    elif args.markdown:
        sys.stdout.write(render_markdown(rows))
    else:
        print(render_text(rows))
    return 0


# --- plugins ------------------------------------------------------------------------


def cmd_plugins(args: argparse.Namespace) -> int:
    from enginecore.backend_listing import DESCRIBED_KINDS, describe_component
    from enginecore.plugins import PluginSelection, make_plugin_manager

    # The listing is the diagnostic for failures, so it never stops at the first one;
    # under strict mode it still exits non-zero when any plugin failed.
    host = make_plugin_manager(strict=False)
    strict = PluginSelection.from_env().strict
    host.all_registries()  # runs every registration hook, so "registered" is filled in
    findings = []
    if args.check:
        from enginecore.plugin_check import check_plugins

        findings = check_plugins(host)
    failed_check = any(f.severity == "error" for f in findings) or bool(host.failed)
    failed_check = failed_check or any(r.rejected for r in host.records.values())
    fail_exit = (args.check or strict) and failed_check
    records = sorted(host.records.values(), key=lambda r: (not r.builtin, r.name))
    if args.json:
        listing = [r.to_json() for r in records]
        if args.check:
            for item in listing:
                item["problems"] = [f.to_json() for f in findings if f.plugin == item["name"]]
        print(json.dumps(listing, indent=2))
        return 1 if fail_exit else 0
    for r in records:
        origin = "builtin" if r.builtin else f"{r.distribution} {r.version}"
        status = "" if r.loaded else "  [FAILED]"
        print(f"{r.name}  ({origin}){status}")
        print(f"    module: {r.module}")
        if r.hooks:
            print(f"    hooks: {', '.join(r.hooks)}")
        for kind, names in sorted(r.registered.items()):
            print(f"    {kind}: {', '.join(names)}")
            if kind in DESCRIBED_KINDS:  # what each supports: what "auto" would pick
                for name in names:
                    print(f"        {name}: {describe_component(host, kind, name)}")
        for entry, problem in sorted(r.rejected.items()):
            print(f"    rejected: {entry}: {problem}")
        if r.error:
            print(f"    error: {r.error}")
            if args.verbose and r.traceback:
                print("    " + r.traceback.replace("\n", "\n    "))
    if host.failed:
        print(
            f"\n{len(host.failed)} plugin(s) failed to load; run with -v for tracebacks.",
            file=sys.stderr,
        )
    if args.check:
        for finding in findings:
            print(finding, file=sys.stderr)
        errors = sum(f.severity == "error" for f in findings)
        verdict = f"{errors} problem(s) to fix" if errors else "all plugins passed the checks"
        print(f"check: {verdict}", file=sys.stderr)
    if strict and host.failed:
        print("strict mode (ENGINECORE_STRICT_PLUGINS=1): a plugin failed", file=sys.stderr)
    return 1 if fail_exit else 0


# --- config -------------------------------------------------------------------------


def cmd_config_show(args: argparse.Namespace) -> int:
    from enginecore.component_check import check_components
    from enginecore.plugins import make_plugin_manager

    config = _resolve_config(args)
    check_components(config, make_plugin_manager(config.plugins.enabled, config.plugins.disabled))
    data = config.to_dict()
    if data["server"]["api_key"] is not None:  # a secret: shown as set, never printed
        data["server"]["api_key"] = "********"
    if args.format == "json":
        print(json.dumps(data, indent=2))
    else:
        for section, fields in data.items():
            print(f"[{section}]")
            for key, value in fields.items():
                # TOML has no null: unset keys are shown commented out.
                print(f"# {key} = (unset)" if value is None else f"{key} = {_toml(value)}")
            print()
    return 0


def _toml(value: object) -> str:
    """A value as TOML (JSON's strings, numbers and lists are TOML; tables are not)."""
    if isinstance(value, dict):
        items = ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items())
        return "{" + items + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


# --- models -------------------------------------------------------------------------


def cmd_disagg_proxy(args: argparse.Namespace) -> int:
    from enginecore.server.disagg_proxy import run

    run(args.prefill, args.decode, args.host, args.port)
    return 0


def cmd_demo_model(args: argparse.Namespace) -> int:
    from enginecore import checkpoints

    if args.random:
        if not args.dir:
            raise EngineCoreError("--random needs a target DIR")
        path = checkpoints.make_random_checkpoint(
            args.dir, arch=args.arch, size=args.size, seed=args.seed
        )
    else:
        path = checkpoints.make_demo_checkpoint(args.dir)
    print(path)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from enginecore import LLM, SamplingParams

    config = _resolve_config(args)
    if not config.model.path:
        from enginecore import checkpoints

        config = config.replace(model=str(checkpoints.make_demo_checkpoint()))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed_sampling
    )
    llm = LLM(config=config)
    try:
        prompts = args.prompt or ["The capital of France is"]
        if args.chat:
            outputs = [llm.chat([{"role": "user", "content": p}], params)[0] for p in prompts]
        else:
            outputs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outputs, strict=True):
            print(f"{prompt!r} -> {out.outputs[0].text!r}")
    finally:
        llm.shutdown()
    return 0


DEMO_MODEL_NAME = "enginecore-demo"


def cmd_serve(args: argparse.Namespace) -> int:
    from enginecore.hub import resolve_model

    config = resolve_model(_resolve_config(args))
    if not config.model.path:
        from enginecore import checkpoints

        config = config.replace(model=str(checkpoints.make_demo_checkpoint()))
        if not config.model.served_model_name:  # not its cache path as the model id
            config = config.replace(served_model_name=DEMO_MODEL_NAME)
    from enginecore.server.launch import run_server

    return run_server(config)


# --- benchmarks ----------------------------------------------------------------------


BENCHMARKS = {
    "throughput": ("enginecore.bench.throughput", "offline throughput against transformers"),
    "latency": ("enginecore.bench.latency", "end-to-end latency of one batch"),
    "serve": ("enginecore.bench.serving", "load-test a running OpenAI-compatible server"),
    "compare": ("enginecore.bench.compare", "ours against vLLM, transformers, llama.cpp"),
    "decode": ("enginecore.bench.decode", "single-stream decode beside its read bound"),
}


def cmd_bench(args: argparse.Namespace) -> int:
    import importlib

    code: int = importlib.import_module(BENCHMARKS[args.bench_command][0]).run(args)
    return code


# --- entry point ----------------------------------------------------------------------


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS: given after the subcommand it wins; not given, the top-level value stays.
    parser.add_argument(
        "--log-level",
        default=argparse.SUPPRESS,
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="enginecore", description="LLM inference engine core with plugins")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=LOG_LEVELS,
        help="logging level (also accepted after the subcommand)",
    )
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    _add_engine_args(p, model_positional=True)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate text for prompts, offline")
    _add_engine_args(p, model_positional=True)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--chat", action="store_true", help="apply the chat template")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--sampling-seed", dest="seed_sampling", type=int, default=None)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "models", help="list the model architectures, their plugins and their features"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--markdown", action="store_true", help="the built-ins as docs/models.md holds them"
    )
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("plugins", help="list loaded plugins and what they registered")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--check",
        action="store_true",
        help="also import and validate every registered component; exit 1 on any problem",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="show tracebacks")
    p.set_defaults(func=cmd_plugins)

    from enginecore.cli_rpc import add_rpc_parser
    from enginecore.starter.cli import add_plugin_new_parser

    # Those modules add plain argparse parsers; ours subclass it (the subparser type is
    # invariant in typeshed, not at run time).
    plain = typing.cast("argparse._SubParsersAction[argparse.ArgumentParser]", sub)
    add_rpc_parser(plain)
    add_plugin_new_parser(plain)

    p = sub.add_parser("config", help="configuration tools")
    config_sub = p.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved configuration")
    _add_engine_args(show, model_positional=False)
    show.add_argument("--format", choices=["toml", "json"], default="toml")
    show.set_defaults(func=cmd_config_show)

    p = sub.add_parser("bench", help="benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text) in BENCHMARKS.items():
        import importlib

        bench = bench_sub.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(bench)
        bench.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "disagg-proxy", help="route requests to prefill then decode instances (zmq_p2p)"
    )
    p.add_argument("--prefill", action="append", required=True, metavar="URL")
    p.add_argument("--decode", action="append", required=True, metavar="URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.set_defaults(func=cmd_disagg_proxy)

    from enginecore.checkpoints import Arch  # light: the heavy imports are lazy there

    p = sub.add_parser("demo-model", help="make the offline demo model (or a random one)")
    p.add_argument("dir", nargs="?", help="target directory (default: the cache)")
    p.add_argument("--random", action="store_true", help="seeded random weights instead")
    p.add_argument("--arch", default="llama", choices=get_args(Arch))
    p.add_argument("--size", default="tiny", choices=["tiny", "small"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo_model)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = translate_vllm_flags(sys.argv[1:] if argv is None else argv)
    except EngineCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.version:
        from enginecore.version import PLUGIN_API_VERSION, __version__

        print(f"enginecore {__version__} (plugin API {PLUGIN_API_VERSION})")
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except EngineCoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("enginecore: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Output piped into a reader that stopped (``| head``): not an error of ours.
        # Python's recipe: point stdout at devnull so the exit's flush cannot fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""``enginecore bench compare``: enginecore against its peers, alternately, in one run.

Two workloads, on the same checkpoint and the same random token-id prompts for every
system (greedy, EOS ignored, so every system does the same work):

- ``throughput``: offline generation of ``batch_size`` prompts at once, for each batch
  size; output tokens/s against batch size. Peers: vLLM (``LLM.generate``), transformers
  (``generate``, one static batch), llama.cpp (``llama-cpp-python``, on a GGUF file, one
  sequence at a time: the binding has no batched decoding).
- ``serving``: each system's OpenAI-compatible server, loaded by the same client
  (``enginecore bench serve``'s) at each request rate; TTFT and TPOT against request rate.
  Peer: vLLM (``vllm serve``).

Every peer runs in its own virtual environment under ``$PEERS`` (made by the install
scripts in ``benchmarks/peers/``), through the runner scripts there. The systems take
turns: round ``r`` runs each once, in an order that rotates every round, so a machine
whose speed drifts over minutes affects all of them alike. Each figure is the median over
rounds. Writes a JSON result, a markdown table (ours, each peer, the ratio) and a plot.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

OURS = "enginecore"
PEERS = ("vllm", "transformers", "llamacpp")
WORKLOADS = ("throughput", "serving")
# Each peer's virtual environment under $PEERS, and the script that makes it.
PEER_VENVS = {
    "vllm": ("vllm-cpu-venv", "install_vllm.sh"),
    "transformers": ("transformers-venv", "install_transformers.sh"),
    "llamacpp": ("llamacpp-venv", "install_llamacpp.sh"),
}
SERVING_PEERS = ("vllm",)
PEERS_DIR_IN_REPO = pathlib.Path(__file__).resolve().parents[3] / "benchmarks" / "peers"


# --- arguments ---------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def _rate_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of request rates: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"request rates must be > 0 ('inf' for all at once): {text!r}"
        )
    return values


def parse_peers(text: str) -> list[str]:
    """``vllm,transformers`` -> the peers, in order; an unknown name is an error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown peer(s) {', '.join(unknown)}; choose from {', '.join(PEERS)}"
        )
    return list(dict.fromkeys(names))


def _python_override(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or name not in (OURS, *PEERS) or not path:
        raise argparse.ArgumentTypeError(
            f"--python takes SYSTEM=PATH with SYSTEM one of {OURS}, {', '.join(PEERS)}: {text!r}"
        )
    return name, path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", help="HF checkpoint directory (all systems); 'demo': the demo model"
    )
    parser.add_argument("--peers", type=parse_peers, default=["vllm", "transformers"])
    parser.add_argument("--workload", choices=WORKLOADS, default="throughput")
    parser.add_argument(
        "--batch-sizes", type=_int_list, default=[1, 16, 64, 256], help="throughput: comma list"
    )
    parser.add_argument(
        "--request-rates", type=_rate_list, default=[2.0, 8.0, 32.0], help="serving: req/s list"
    )
    parser.add_argument("--num-prompts", type=int, default=200, help="serving: per rate")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2, help="turns each system takes")
    parser.add_argument("--reps", type=int, default=1, help="throughput: timed runs per turn")
    parser.add_argument(
        "--gguf", help="GGUF file of the same model, for llamacpp; 'demo': the demo model's"
    )
    parser.add_argument(
        "--peers-dir",
        default=os.environ.get("PEERS"),
        help="where the peers' venvs live (default $PEERS)",
    )
    parser.add_argument(
        "--python",
        type=_python_override,
        action="append",
        default=[],
        metavar="SYSTEM=PATH",
        help="interpreter for a system (default: $PEERS/<its venv>/bin/python; ours: this one)",
    )
    parser.add_argument("--output-json", help="write the result here")
    parser.add_argument("--plot", help="write the plot (PNG) here; needs matplotlib")
    parser.add_argument(
        "--from-json", help="no run: print the table and draw the plot of a recorded result"
    )


def check_args(args: argparse.Namespace) -> None:
    """Errors that name the flag at fault, before anything starts."""
    if args.from_json:
        return
    if not args.model:
        raise SystemExit("compare: give the model directory (or --from-json FILE)")
    if not PEERS_DIR_IN_REPO.is_dir():
        raise SystemExit(
            f"compare: the runners are not at {PEERS_DIR_IN_REPO}: run it from a source "
            "checkout (pip install -e .)"
        )
    if args.rounds < 1 or args.reps < 1:
        raise SystemExit("compare: --rounds and --reps must be at least 1")
    if args.input_len + args.output_len > args.max_model_len:
        raise SystemExit("compare: --input-len + --output-len exceeds --max-model-len")
    if args.workload == "serving":
        others = [p for p in args.peers if p not in SERVING_PEERS]
        if others:
            raise SystemExit(
                f"compare: no serving workload for {', '.join(others)} (transformers is a "
                "library, not a server; llama-cpp-python's server takes text prompts and "
                "decodes one request at a time): compare it with --workload throughput"
            )
    if "llamacpp" in args.peers and args.workload == "throughput" and not args.gguf:
        raise SystemExit("compare: llamacpp reads GGUF files: pass --gguf FILE of the same model")


def resolve_demo(args: argparse.Namespace) -> None:
    """``demo`` names the demo model: its HF checkpoint, and the GGUF file it comes from."""
    from enginecore import checkpoints

    if args.model == "demo":
        args.model = str(checkpoints.make_demo_checkpoint())
    if args.gguf == "demo":
        args.gguf = str(checkpoints.find_demo_gguf())


def interpreter(system: str, args: argparse.Namespace) -> str:
    overrides: dict[str, str] = dict(args.python)
    if system in overrides:
        return overrides[system]
    if system == OURS:
        return sys.executable
    venv, installer = PEER_VENVS[system]
    if not args.peers_dir:
        raise SystemExit(f"compare: set PEERS (or --peers-dir) to find {system}'s venv")
    python = pathlib.Path(args.peers_dir) / venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(
            f"compare: {system} is not installed at {python.parent.parent}: run "
            f"PEERS={args.peers_dir} benchmarks/peers/{installer}"
        )
    return str(python)


# --- workload ----------------------------------------------------------------------------


def vocab_size(model: str) -> int:
    if model.endswith(".gguf"):  # enginecore on the same GGUF file as llama.cpp
        from enginecore.block_formats.gguf_reader import GGUFMetadata

        return GGUFMetadata(model).vocab_size()
    config = json.loads((pathlib.Path(model) / "config.json").read_text())
    return int(config.get("vocab_size") or config["text_config"]["vocab_size"])


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Token ids above the lowest 256 (special and byte tokens), seeded."""
    rng = random.Random(seed)
    low = min(256, vocab // 2)
    return [[rng.randrange(low, vocab) for _ in range(length)] for _ in range(num)]


def turn_order(systems: list[str], round_index: int) -> list[str]:
    """The order of round ``round_index``: rotated by one each round."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def _peer_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# --- throughput --------------------------------------------------------------------------


def run_throughput(args: argparse.Namespace, systems: list[str]) -> dict[str, list[dict[str, Any]]]:
    prompts = random_prompts(
        max(args.batch_sizes), args.input_len, vocab_size(args.model), args.seed
    )
    spec = {
        "model": args.model,
        "gguf": args.gguf,
        "dtype": args.dtype,
        "prompts": prompts,
        "output_len": args.output_len,
        "batch_sizes": args.batch_sizes,
        "reps": args.reps,
        "max_model_len": args.max_model_len,
    }
    turns: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="enginecore-compare-") as scratch:
        spec_path = os.path.join(scratch, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for r in range(args.rounds):
            for system in turn_order(systems, r):
                out = os.path.join(scratch, f"{system}-{r}.json")
                script = PEERS_DIR_IN_REPO / f"run_{system}.py"
                command = [interpreter(system, args), str(script), spec_path, out]
                print(f"round {r + 1}/{args.rounds}: {system}", flush=True)
                done = subprocess.run(
                    command, env=_peer_env(), capture_output=True, text=True, check=False
                )
                if done.returncode != 0:
                    raise RuntimeError(
                        f"{system} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
                    )
                with open(out) as f:
                    turns[system].append(json.load(f))
                _print_turn(system, turns[system][-1])
    return turns


def _print_turn(system: str, turn: dict[str, Any]) -> None:
    for point in turn["points"]:
        wall = statistics.median(point["rep_walls_s"])
        print(
            f"  {system:>12} batch {point['batch_size']:>4}: "
            f"{point['output_tokens'] / wall:9.1f} out tok/s ({wall:.2f} s)",
            flush=True,
        )


def summarize_throughput(turns: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Per system and batch size: the median wall time over every timed run of every turn."""
    summary: dict[str, list[dict[str, Any]]] = {}
    for system, system_turns in turns.items():
        by_batch: dict[int, list[float]] = {}
        tokens: dict[int, int] = {}
        for turn in system_turns:
            for point in turn["points"]:
                by_batch.setdefault(point["batch_size"], []).extend(point["rep_walls_s"])
                tokens[point["batch_size"]] = point["output_tokens"]
        summary[system] = [
            {
                "batch_size": b,
                "wall_s": statistics.median(walls),
                "output_tok_s": tokens[b] / statistics.median(walls),
                "runs": len(walls),
            }
            for b, walls in sorted(by_batch.items())
        ]
    return summary


# --- serving -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_command(system: str, args: argparse.Namespace, port: int) -> list[str]:
    limits = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    if system == OURS:
        ours = pathlib.Path(interpreter(OURS, args)).parent / "enginecore"
        return [str(ours), "serve", args.model, "--host", "127.0.0.1", "--port", str(port),
                *limits, "--max-num-seqs", "256", "--no-prefix-caching"]  # fmt: skip
    return [interpreter(system, args), str(PEERS_DIR_IN_REPO / "vllm_cli.py"), "serve",
            args.model, "--host", "127.0.0.1", "--port", str(port), *limits,
            "--max-num-seqs", "256", "--no-enable-prefix-caching", "--seed", "0"]  # fmt: skip


def _wait_ready(
    proc: subprocess.Popen[bytes], port: int, log: pathlib.Path, timeout: float
) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2):
                pass
        except OSError:
            time.sleep(0.5)
            continue
        _check_listener(proc, port)
        return time.perf_counter() - start
    raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def _check_listener(proc: subprocess.Popen[bytes], port: int) -> None:
    """The answer came from the server started for this turn (its process group), not from
    another process that took the port before the server could bind it."""
    import psutil

    holders = sorted(
        c.pid
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid
    )
    ours = []
    for pid in holders:
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(pid) == proc.pid:
                ours.append(pid)
    if not ours:
        others = ", ".join(map(str, holders)) or "not visible to us"
        raise RuntimeError(
            f"port {port} was answered by another process (pid {others}), not by the server "
            f"started for this turn (pid {proc.pid})"
        )


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """The server and every process it started (its own process group), all gone before
    the next turn: a peer's engine process can outlive its API server by seconds, taking
    CPU from the next system's turn."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline, killed = time.monotonic() + timeout, False
    while _group_alive(proc):
        if not killed and time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            killed = True
        time.sleep(0.1)
    proc.wait()


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    """Any process of the server's group still running (a zombie, already dead, is not)."""
    proc.poll()  # reaps the leader, our child
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    import psutil

    for member in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(member.pid) == proc.pid and member.info["status"] != psutil.STATUS_ZOMBIE:
                return True
    return False


def run_serving(args: argparse.Namespace, systems: list[str]) -> dict[str, list[dict[str, Any]]]:
    from enginecore.bench.serving import run_load, summarize

    vocab = vocab_size(args.model)
    # Fresh prompts for each rate, the same for every system.
    prompts = {
        rate: random_prompts(args.num_prompts, args.input_len, vocab, args.seed + i)
        for i, rate in enumerate(args.request_rates)
    }
    turns: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
    env = {**_peer_env(), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    with tempfile.TemporaryDirectory(prefix="enginecore-compare-") as scratch:
        for r in range(args.rounds):
            for system in turn_order(systems, r):
                port = _free_port()
                log = pathlib.Path(scratch) / f"{system}-{r}.log"
                print(f"round {r + 1}/{args.rounds}: {system} server", flush=True)
                with open(log, "w") as log_file:
                    proc = subprocess.Popen(
                        server_command(system, args, port),
                        env=env,
                        stdout=log_file,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                try:
                    ready_s = _wait_ready(proc, port, log, timeout=600)
                    points = []
                    for i, rate in enumerate(args.request_rates):
                        results, duration = asyncio.run(
                            run_load(
                                f"http://127.0.0.1:{port}",
                                prompts[rate],
                                args.output_len,
                                rate,
                                None,
                                seed=args.seed + i,
                                progress=False,
                            )
                        )
                        point = summarize(results, duration, rate)
                        if point["failed"]:
                            raise RuntimeError(
                                f"{system}: failed requests: {point['errors']}\n"
                                f"server log:\n{log.read_text()[-3000:]}"
                            )
                        points.append(point)
                        print(
                            f"  {system:>12} rate {rate:>6}: TTFT p50 {point['p50_ttft_ms']:7.1f} ms"
                            f"  TPOT p50 {point['p50_tpot_ms']:6.2f} ms"
                            f"  {point['output_throughput']:7.1f} out tok/s",
                            flush=True,
                        )
                finally:
                    _stop(proc)
                turns[system].append({"ready_s": ready_s, "points": points})
    return turns


SERVING_METRICS = ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms", "output_throughput")


def summarize_serving(turns: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Per system and request rate: the median of each metric over the turns."""
    summary: dict[str, list[dict[str, Any]]] = {}
    for system, system_turns in turns.items():
        by_rate: dict[str, list[dict[str, Any]]] = {}
        for turn in system_turns:
            for point in turn["points"]:
                by_rate.setdefault(str(point["request_rate"]), []).append(point)
        summary[system] = [
            {
                "request_rate": points[0]["request_rate"],
                **{m: statistics.median(p[m] for p in points) for m in SERVING_METRICS},
                "runs": len(points),
            }
            for points in by_rate.values()
        ]
    return summary


# --- result, table, plot -----------------------------------------------------------------


def machine_line() -> str:
    model, flags = platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    isa = [name for name, flag in (("AVX2", "avx2"), ("AVX-512", "avx512f"), ("AMX", "amx_tile"))
           if flag in flags]  # fmt: skip
    return f"{model}, {os.cpu_count()} cores" + (f", {' + '.join(isa)}" if isa else "")


def ratios(
    summary: dict[str, list[dict[str, Any]]], key: str, metric: str
) -> dict[str, list[dict[str, Any]]]:
    """Ours over each peer, point by point (for times, a ratio below 1 means we are faster)."""
    ours = {p[key]: p[metric] for p in summary.get(OURS, [])}
    out: dict[str, list[dict[str, Any]]] = {}
    for system, points in summary.items():
        if system == OURS:
            continue
        out[system] = [
            {key: p[key], "ours_over_peer": ours[p[key]] / p[metric]}
            for p in points
            if p[key] in ours and p[metric]
        ]
    return out


def build_result(
    args: argparse.Namespace, turns: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    if args.workload == "throughput":
        summary = summarize_throughput(turns)
        result_ratios = {"output_tok_s": ratios(summary, "batch_size", "output_tok_s")}
    else:
        summary = summarize_serving(turns)
        result_ratios = {
            m: ratios(summary, "request_rate", m)
            for m in ("p50_ttft_ms", "p50_tpot_ms", "output_throughput")
        }
    return {
        "workload": args.workload,
        "machine": machine_line(),
        "command": shlex.join(["enginecore", "bench", "compare", *_argv_after("compare")]),
        "settings": {
            "model": args.model,
            "gguf": args.gguf,
            "dtype": args.dtype,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "rounds": args.rounds,
            "reps": args.reps,
            "seed": args.seed,
            **(
                {"batch_sizes": args.batch_sizes}
                if args.workload == "throughput"
                else {"request_rates": args.request_rates, "num_prompts": args.num_prompts}
            ),
        },
        "systems": {
            s: {"version": t[0].get("version", ""), "turns": t} for s, t in turns.items() if t
        },
        "summary": summary,
        "ratios": result_ratios,
    }


def _argv_after(word: str) -> list[str]:
    argv = sys.argv[1:]
    return argv[argv.index(word) + 1 :] if word in argv else argv


def markdown_table(result: dict[str, Any]) -> str:
    """One table: a row per batch size (or request rate), ours, each peer, the ratio."""
    summary = result["summary"]
    peers = [s for s in summary if s != OURS]
    if result["workload"] == "throughput":
        key, metrics = "batch_size", [("output_tok_s", "out tok/s", "{:,.0f}")]
    else:
        key = "request_rate"
        metrics = [
            ("p50_ttft_ms", "TTFT p50 ms", "{:,.1f}"),
            ("p50_tpot_ms", "TPOT p50 ms", "{:,.2f}"),
            ("output_throughput", "out tok/s", "{:,.0f}"),
        ]
    header = ["batch" if key == "batch_size" else "req/s"]
    for _, label, _ in metrics:
        header.append(f"{OURS} {label}")
        for peer in peers:
            header += [f"{peer}", "ratio"]
    rows = [header, ["---"] * len(header)]
    ours = {p[key]: p for p in summary.get(OURS, [])}
    for point in summary.get(OURS, []):
        row = [str(point[key])]
        for metric, _, fmt in metrics:
            row.append(fmt.format(point[metric]))
            for peer in peers:
                theirs = {p[key]: p for p in summary[peer]}.get(point[key])
                if theirs is None or not theirs[metric]:
                    row += ["—", "—"]
                else:
                    row += [
                        fmt.format(theirs[metric]),
                        f"{ours[point[key]][metric] / theirs[metric]:.2f}",
                    ]
        rows.append(row)
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def plot_result(result: dict[str, Any], path: str) -> None:
    """Throughput against batch size, or TTFT / TPOT / throughput against request rate."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "compare: --plot needs matplotlib: pip install 'enginecore[bench]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    versions = {s: v.get("version", "") for s, v in result.get("systems", {}).items()}

    def label(system: str) -> str:
        return f"{system} {versions.get(system, '')}".strip()

    if result["workload"] == "throughput":
        fig, ax = plt.subplots(figsize=(6.5, 4.5))
        for system, points in summary.items():
            xs = [p["batch_size"] for p in points]
            ax.plot(xs, [p["output_tok_s"] for p in points], "o-", label=label(system))
        ax.set(xscale="log", xlabel="batch size (prompts at once)", ylabel="output tokens/s")
        ax.set_xticks(
            result["settings"]["batch_sizes"], labels=map(str, result["settings"]["batch_sizes"])
        )
        ax.minorticks_off()
        axes = [ax]
    else:
        fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
        panels = (("p50_ttft_ms", "TTFT p50 (ms)"), ("p50_tpot_ms", "TPOT p50 (ms)"),
                  ("output_throughput", "output tokens/s"))  # fmt: skip
        for ax, (metric, ylabel) in zip(axes, panels, strict=True):
            for system, points in summary.items():
                finite = [p for p in points if p["request_rate"] != "inf"]
                ax.plot([p["request_rate"] for p in finite], [p[metric] for p in finite], "o-",
                        label=label(system))  # fmt: skip
            ax.set(xlabel="request rate (req/s)", ylabel=ylabel, xscale="log")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend()
    settings = result["settings"]
    fig.suptitle(
        f"{pathlib.Path(settings['model']).name}, {settings['dtype']}, "
        f"{settings['input_len']} in / {settings['output_len']} out — {result['machine']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    if args.from_json:
        result = json.loads(pathlib.Path(args.from_json).read_text())
    else:
        resolve_demo(args)
        systems = [OURS, *args.peers]
        for system in systems:  # every interpreter found before the first turn starts
            interpreter(system, args)
        runner = run_throughput if args.workload == "throughput" else run_serving
        result = build_result(args, runner(args, systems))
    print(f"\n{result['machine']}\n")
    print(markdown_table(result))
    if args.output_json and not args.from_json:
        pathlib.Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot_result(result, args.plot)
        print(f"plot written to {args.plot}")
    return 0

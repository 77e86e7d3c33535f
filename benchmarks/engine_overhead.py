"""Engine host overhead per step, and end-to-end step() vs step_with_batch_queue().

Part 1 (no model): schedule() + update_from_output() with N running decodes, then the
step's EngineCoreOutputs encoded (engine output thread) and decoded (frontend). The
model runner is faked (one sampled token per request, built outside the timed region).

Part 2 (``--e2e MODEL_DIR``): output tokens/s of the in-process engine with synchronous
stepping and with async scheduling (batch queue of 2) on a real checkpoint.

    python benchmarks/engine_overhead.py [--steps 2000] [--sizes 1,8,32,128,256,512]
    python benchmarks/engine_overhead.py --sizes '' --e2e /path/to/tiny-llama
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from enginecore import SamplingParams, make_config
from enginecore.protocol import EngineCoreOutputs, EngineCoreRequest
from enginecore.request import Request
from enginecore.runner_output import ModelRunnerOutput
from enginecore.serial import MsgpackDecoder, MsgpackEncoder
from enginecore_schedulers.policies import FCFSPolicy
from enginecore_schedulers.scheduler import DefaultScheduler


def bench(num_decodes: int, steps: int, prompt_len: int, block_size: int) -> tuple[float, ...]:
    """Median microseconds per decode step: ``(schedule+update, mean of it, encode+decode)``.

    The median is the figure to quote: it ignores steps slowed by other processes on a
    shared machine.
    """
    config = make_config(model="bench", block_size=block_size, max_num_seqs=max(num_decodes, 1))
    # Early requests decode while later ones still prefill: leave room for both phases.
    max_model_len = prompt_len + steps + num_decodes + 64
    blocks_per_req = -(-max_model_len // block_size)
    scheduler = DefaultScheduler(
        config,
        num_blocks=num_decodes * blocks_per_req + 2,
        max_model_len=max_model_len,
        policy=FCFSPolicy(config),
        log_stats=True,
    )
    scheduler.plain_output_columns = True  # as the engine asks for its frontends
    params = SamplingParams(max_tokens=max_model_len - prompt_len, ignore_eos=True)
    for i in range(num_decodes):
        prompt = [(i * 7919 + j) % 32000 for j in range(prompt_len)]
        scheduler.add_request(Request(str(i), prompt, params, eos_token_id=2, seq_no=i))
    # Prefill (possibly over several steps) until everything decodes.
    while True:
        out = scheduler.schedule()
        ids = list(out.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: k for k, r in enumerate(ids)},
            sampled_token_ids=[[5] for _ in ids],
        )
        scheduler.update_from_output(out, runner)
        if all(n == 1 for n in out.num_scheduled_tokens.values()) and len(ids) == num_decodes:
            break
    # Runner outputs are prepared outside the timed region: the scheduled ids are the
    # same every step, in the same order.
    ids = list(out.num_scheduled_tokens)
    runner = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: k for k, r in enumerate(ids)},
        sampled_token_ids=[[5 + (k % 7)] for k in range(len(ids))],
    )
    encoder = MsgpackEncoder()
    decoder = MsgpackDecoder(EngineCoreOutputs)
    gc.collect()
    times, wire_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        outputs = scheduler.update_from_output(out, runner)
        t1 = time.perf_counter()
        stats = scheduler.make_stats()
        for client_outputs in outputs.values():
            client_outputs.scheduler_stats = stats
            decoder.decode(encoder.encode(client_outputs.stamp()))
        t2 = time.perf_counter()
        times.append(t1 - t0)
        wire_times.append(t2 - t1)
        assert out.total_num_scheduled_tokens == num_decodes
    return (
        statistics.median(times) * 1e6,
        statistics.fmean(times) * 1e6,
        statistics.median(wire_times) * 1e6,
    )


def e2e(model: str, num_prompts: int, input_len: int, output_len: int) -> None:
    """Output tokens/s of step() vs step_with_batch_queue() on one checkpoint."""
    from enginecore.engine.client import InprocClient

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 8000) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for async_scheduling in (False, True):
        config = make_config(
            model=model, dtype="float32", async_scheduling=async_scheduling, max_num_seqs=256
        )
        client = InprocClient(config)
        try:
            for warm in (True, False):
                n = 4 if warm else num_prompts
                for i, prompt in enumerate(prompts[:n]):
                    client.add_request(
                        EngineCoreRequest(
                            request_id=f"{warm}-{i}",
                            prompt_token_ids=prompt,
                            sampling_params=params,
                            arrival_time=time.monotonic(),
                        )
                    )
                t0 = time.perf_counter()
                tokens = 0
                while client.engine.has_work():
                    outputs = client.get_output().all_outputs()
                    tokens += sum(len(o.new_token_ids) for o in outputs)
                wall = time.perf_counter() - t0
            mode = "step_with_batch_queue" if async_scheduling else "step"
            print(
                f"{mode:>22}: {tokens} output tokens in {wall:.2f} s = "
                f"{tokens / wall:,.0f} tok/s ({num_prompts} prompts, {input_len} in / {output_len} out)"
            )
        finally:
            client.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--sizes", default="1,8,32,128,256,512")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--e2e", metavar="MODEL_DIR", help="also measure step vs batch queue")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if sizes:
        print(
            f"{'decodes':>8} {'sched+update us':>16} {'(mean)':>8} {'us/request':>11} "
            f"{'encode+decode us':>17} {'host path us':>13}"
        )
    for n in sizes:
        median, mean, wire = bench(n, args.steps, args.prompt_len, args.block_size)
        print(
            f"{n:>8} {median:>16.1f} {mean:>8.1f} {median / n:>11.2f} {wire:>17.1f} "
            f"{median + wire:>13.1f}"
        )
    if args.e2e:
        e2e(args.e2e, args.num_prompts, args.input_len, args.output_len)


if __name__ == "__main__":
    main()

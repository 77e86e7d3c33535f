"""One rank of the external_launcher determinism proof (run under torchrun).

Every rank builds a whole engine (in-process, executor external_launcher), records each
SchedulerOutput its own scheduler produces, generates a mixed batch, and writes both to
``OUT_DIR/rank{RANK}.msgpack``. The test compares the files.

usage: torchrun --nproc-per-node 2 torchrun_engine.py MODEL OUT_DIR
"""

from __future__ import annotations

import os
import pathlib
import sys

import msgspec

from enginecore import LLM, SamplingParams


def canonical(scheduler_output) -> dict:
    """The SchedulerOutput as plain data; sets (unordered by nature) become sorted lists."""
    data = msgspec.to_builtins(scheduler_output)
    for key in ("finished_req_ids", "preempted_req_ids"):
        data[key] = sorted(data.get(key) or [])
    return data


def main() -> None:
    model, out_dir = sys.argv[1], pathlib.Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    llm = LLM(
        model,
        executor="external_launcher",
        tensor_parallel_size=int(os.environ["WORLD_SIZE"]),
        dtype="float32",
        num_blocks_override=24,  # small: forces preemption and block reuse
        max_num_seqs=6,
        max_num_batched_tokens=64,  # small: forces chunked prefill
        block_size=4,
    )
    scheduler = llm.engine_client.engine.scheduler
    steps: list[dict] = []
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        steps.append(canonical(out))
        return out

    scheduler.schedule = recording_schedule
    prompts = [
        "the quick brown fox jumps over the lazy dog " * (1 + i % 4) + str(i) for i in range(10)
    ]
    params = [
        SamplingParams(max_tokens=8 + 3 * (i % 5), temperature=0.0, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=100 + i)
        for i in range(10)
    ]
    outputs = llm.generate(prompts, params)
    result = {
        "rank": rank,
        "pid": os.getpid(),
        "executor": llm.engine_client.ready.components["executor"],
        "client": type(llm.engine_client).__name__,
        "world": llm.collective_rpc(lambda w: (w.rank, w.parallel.tp_size)),
        "steps": steps,
        "outputs": [(o.request_id, o.outputs[0].token_ids, o.outputs[0].text) for o in outputs],
    }
    (out_dir / f"rank{rank}.msgpack").write_bytes(msgspec.msgpack.encode(result))
    llm.shutdown()


if __name__ == "__main__":
    main()

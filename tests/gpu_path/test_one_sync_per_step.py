"""A step reads the device back once: the sampled ids (and logprobs) in one copy.

On a GPU every read of a device value on the host waits for all queued work, and each
one between the forward and the step's outputs leaves the GPU idle. On CPU the same
reads are counted (``tests/helpers/sync_counter.py``). A decode step over a batch that uses every
sampling feature (top-k, top-p, min-p, penalties, logprobs, a seed) must count exactly
one: the wait on the step's device-to-host copy.
"""

from __future__ import annotations

import pytest

from enginecore import SamplingParams
from tests.helpers.model_runner import PROMPTS, driver_for, make_runner
from tests.helpers.sync_counter import BlockingCopyCounter, count_reads

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=8),
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=8),
    SamplingParams(temperature=1.0, min_p=0.05, seed=7, max_tokens=8),
    SamplingParams(
        temperature=0.7,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logprobs=2,
        max_tokens=8,
    ),
]


def test_decode_steps_read_the_device_once(tiny_llama, model_refs):
    runner = make_runner(tiny_llama, model_refs)
    counter = count_reads(runner)
    driver = driver_for(runner, budget=256)
    for i, params in enumerate(PARAMS):
        driver.add(f"r{i}", PROMPTS["c"][: 8 + i], max_tokens=8, params=params)
    driver.step()  # the prompts
    per_step = []
    for _ in range(3):
        counter.reads.clear()
        with counter:
            out = driver.step()
        assert all(len(t) == 1 for t in out.sampled_token_ids)
        per_step.append(list(counter.reads))
    assert per_step == [["event.synchronize"]] * 3


def test_sampling_inputs_are_staged_without_a_blocking_copy(tiny_llama, model_refs):
    """The sampling half of a decode step (every sampling feature) puts its row indices
    and parameters on the device through the pinned staging buffers: no copy that
    waits for the forward queued before it."""
    runner = make_runner(tiny_llama, model_refs)
    driver = driver_for(runner, budget=256)
    special = [
        SamplingParams(temperature=0.9, logit_bias={5: 2.0}, min_tokens=6, max_tokens=8),
        SamplingParams(temperature=0.0, logprob_token_ids=[5, 1, 40], max_tokens=8),
    ]
    for i, params in enumerate([*PARAMS, *special]):
        driver.add(f"r{i}", PROMPTS["c"][: 8 + i], max_tokens=8, params=params)
    driver.step()
    counter = BlockingCopyCounter()
    sample_tokens = runner.sample_tokens

    def counted(grammar):
        with counter:
            return sample_tokens(grammar)

    runner.sample_tokens = counted
    for _ in range(2):
        driver.step()
    assert counter.copies == []


def test_listed_logprob_token_ids_ride_the_same_copy(tiny_llama, model_refs):
    """vLLM's ``logprob_token_ids`` beside top-k rows: still one read per step, and each
    listed row reports exactly its ids."""
    runner = make_runner(tiny_llama, model_refs)
    counter = count_reads(runner)
    driver = driver_for(runner, budget=256)
    listed = [5, 1, 40]
    params = [*PARAMS, SamplingParams(temperature=0.0, logprob_token_ids=listed, max_tokens=8)]
    for i, p in enumerate(params):
        driver.add(f"r{i}", PROMPTS["c"][: 8 + i], max_tokens=8, params=p)
    driver.step()
    for _ in range(2):
        counter.reads.clear()
        with counter:
            out = driver.step()
        assert counter.reads == ["event.synchronize"]
        assert out.logprobs is not None
        row = out.req_id_to_index["r4"]
        ids = out.logprobs.logprob_token_ids[row]
        assert ids == [out.sampled_token_ids[row][0], *listed]
        assert len(out.logprobs.logprob_token_ids[out.req_id_to_index["r3"]]) == 3


def test_prompt_logprobs_ride_the_step_copy(tiny_llama, model_refs):
    """Prompt logprobs scored over several prefill chunks: a chunk that samples nothing
    reads nothing, and the step that samples the first token reads once (the chunks'
    scores travel with its copy)."""
    runner = make_runner(tiny_llama, model_refs)
    counter = count_reads(runner)
    driver = driver_for(runner, budget=12)  # 30-token prompts: three chunks
    # A first request makes the staging and host buffers (made once, on first use).
    driver.add("warm", PROMPTS["c"], max_tokens=1, params=SamplingParams(prompt_logprobs=2))
    while driver.reqs:
        driver.step()
    driver.add("p0", PROMPTS["c"], max_tokens=3, params=SamplingParams(prompt_logprobs=2))
    driver.add("p1", PROMPTS["b"], max_tokens=3, params=SamplingParams(prompt_logprobs=0))
    per_step, results = [], []
    while driver.reqs:
        counter.reads.clear()
        with counter:
            out = driver.step()
        sampled = any(out.sampled_token_ids)
        per_step.append((sampled, list(counter.reads)))
        results.append(out.prompt_logprobs or {})
    assert [reads for sampled, reads in per_step if not sampled] == [[]] * sum(
        1 for sampled, _ in per_step if not sampled
    )
    assert [reads for sampled, reads in per_step if sampled] == [["event.synchronize"]] * sum(
        1 for sampled, _ in per_step if sampled
    )
    got = {r: lp for step in results for r, lp in step.items()}
    assert len(got["p0"].sampled_token_ranks) == len(PROMPTS["c"]) - 1
    assert [row[0] for row in got["p0"].logprob_token_ids] == PROMPTS["c"][1:]
    assert all(len(row) == 3 for row in got["p0"].logprob_token_ids)
    assert [row[0] for row in got["p1"].logprob_token_ids] == PROMPTS["b"][1:]


SPEC_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=12),
    SamplingParams(temperature=0.7, frequency_penalty=0.3, logprobs=2, max_tokens=12),
]


def test_verify_steps_read_the_device_once(tiny_llama, model_refs):
    """N-gram drafts verified in one forward: targets, logprobs and acceptance come from
    one copy per step, and the drafts proposed for the next step need no other read."""
    runner = make_runner(
        tiny_llama,
        model_refs,
        proposer_ref="enginecore_models.ngram_proposer:NgramProposer",
        speculative_method="ngram",
        num_speculative_tokens=3,
    )
    counter = count_reads(runner)
    copies = BlockingCopyCounter()
    driver = SpecDriver(runner)
    for i, params in enumerate(SPEC_PARAMS):
        driver.add(f"s{i}", PROMPTS["c"][: 12 + i], params)
    driver.step()  # the prompts
    sample_tokens = runner.sample_tokens

    def counted(grammar):
        with copies:
            return sample_tokens(grammar)

    runner.sample_tokens = counted
    verified = 0
    for _ in range(4):
        counter.reads.clear()
        with counter:
            out = driver.step()
        verified += sum(out.num_draft_tokens)
        assert counter.reads == ["event.synchronize"]
    assert verified > 0  # the repeating prompts give the proposer drafts to verify
    assert copies.copies == []  # the verify rows' parameters are staged too


class SpecDriver:
    """Hand-built scheduler outputs that verify the drafts the runner proposed."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.free = list(range(1, runner.num_blocks))
        self.reqs: dict[str, dict] = {}
        self.step_id = 0

    def add(self, req_id: str, prompt: list[int], params: SamplingParams) -> None:
        self.reqs[req_id] = dict(prompt=prompt, params=params, blocks=[], computed=0, sent=False)
        self.reqs[req_id].update(known=len(prompt), drafts=[])

    def step(self):
        from enginecore.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

        new, cached, num, spec = [], CachedRequestData(), {}, {}
        for req_id, req in self.reqs.items():
            n = req["known"] - req["computed"] + len(req["drafts"])
            need = -(-(req["computed"] + n) // self.runner.block_size) - len(req["blocks"])
            fresh = [self.free.pop() for _ in range(need)]
            req["blocks"] += fresh
            if not req["sent"]:
                new.append(
                    NewRequestData(
                        req_id=req_id,
                        prompt_token_ids=req["prompt"],
                        sampling_params=req["params"],
                        block_ids=list(req["blocks"]),
                        num_computed_tokens=0,
                    )
                )
                req["sent"] = True
            else:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(fresh or None)
                cached.num_computed_tokens.append(req["computed"])
            num[req_id] = n
            if req["drafts"]:
                spec[req_id] = list(req["drafts"])
        so = SchedulerOutput(
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num,
            total_num_scheduled_tokens=sum(num.values()),
            scheduled_spec_decode_tokens=spec,
            step_id=self.step_id,
        )
        self.step_id += 1
        out = self.runner.execute_model(so)
        if out is None:
            out = self.runner.sample_tokens(None)
        for req_id, req in self.reqs.items():
            i = out.req_id_to_index[req_id]
            req["known"] += len(out.sampled_token_ids[i])
            req["computed"] = req["known"] - 1
            req["drafts"] = out.draft_token_ids[i]
        return out


def _pipeline_stage(rank: int, store: str, path: str, model_refs: dict, results) -> None:
    """One of two pipeline stages (gloo): the prompts, then three counted decode steps."""
    import torch.distributed as dist

    from enginecore.distributed import ParallelContext

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        parallel = ParallelContext(rank=rank, world_size=2, pp_rank=rank, pp_size=2)
        runner = make_runner(path, model_refs, parallel=parallel, pipeline_parallel_size=2)
        counter = count_reads(runner)
        driver = driver_for(runner, budget=256)
        for i, params in enumerate(PARAMS):
            driver.add(f"r{i}", PROMPTS["c"][: 8 + i], max_tokens=8, params=params)
        driver.step()
        per_step = []
        for _ in range(3):
            counter.reads.clear()
            with counter:
                driver.step()
            per_step.append(list(counter.reads))
        results.put((rank, per_step))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes load the model
def test_pipeline_stages_read_the_device_once(tiny_llama, model_refs, tmp_path):
    """Two stages in two processes: the last samples and broadcasts the ids (with
    logprobs beside them), the first learns them; each reads its device once a step."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(
            target=_pipeline_stage, args=(rank, store, str(tiny_llama), model_refs, results)
        )
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got == {0: [["event.synchronize"]] * 3, 1: [["event.synchronize"]] * 3}

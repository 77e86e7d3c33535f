"""Every step's model inputs as the runner hands them to the forward, checked against what
the scheduler's outputs say they must be.

``StepInputs.attach(runner)`` wraps the runner's ``execute_model`` (to see each
``SchedulerOutput``) and ``_run_forward`` (to copy the token ids, positions and the
``AttentionBatch`` it gets, whichever path built them: the general one, the decode
shortcut or the steady-decode path). ``check(tokens)``, once the requests' full token
lists are known (prompt + output), replays the scheduler's outputs: each request's block
ids (new requests' blocks, then each step's new blocks; dropped when finished or
preempted) and its computed-token count give the positions, token ids, slot mapping,
block-table row, query and context lengths every scheduled request must have had. The
``cpu`` backend's decode mirror, where it served the step's decodes, must have written at
each decode's position and attended over one position more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class _Step:
    so: Any  # the SchedulerOutput
    steady: bool  # taken by the steady-decode path
    ids: np.ndarray
    positions: np.ndarray
    req_ids: list[str]
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_table: np.ndarray
    slot_mapping: np.ndarray
    num_decodes: int
    mirror: tuple[np.ndarray, np.ndarray] | None  # write positions, lengths after
    index: int  # among every step (the run ones and the others, in order)


@dataclass
class StepInputs:
    block_size: int
    steps: list[_Step] = field(default_factory=list)  # the steps that ran a forward
    unrun: list[Any] = field(default_factory=list)  # the other SchedulerOutputs

    @classmethod
    def attach(cls, runner: Any) -> StepInputs:
        record = cls(runner.block_size)
        execute, run_forward = runner.execute_model, runner._run_forward
        current: dict[str, Any] = {}

        def execute_model(so: Any) -> Any:
            current["so"], current["steady"] = so, runner.steady_decode_steps
            current["seen"] = False
            try:
                return execute(so)
            finally:
                if not current["seen"]:  # nothing to run (every request waits)
                    record.unrun.append(so)

        def capture(ids_t: Any, pos_t: Any, batch: Any) -> None:
            if current["seen"]:  # the layers' path calls the fused step itself
                return
            current["seen"] = True
            backend = runner.attn_backend
            mirror = getattr(backend, "mirror", None)
            mirrored = None
            # (the flag is the last plan's until the metadata of a step without decodes)
            if mirror is not None and batch.num_decodes and backend.decodes_mirrored():
                mirrored = (mirror.step.write_pos.numpy().copy(), mirror.step.lens.numpy().copy())
            record.steps.append(
                _Step(
                    so=current["so"],
                    steady=runner.steady_decode_steps > current["steady"],
                    ids=ids_t.cpu().numpy().copy(),
                    positions=pos_t.cpu().numpy().copy(),
                    req_ids=list(batch.req_ids),
                    query_lens=np.array(batch.query_lens),
                    context_lens=np.array(batch.context_lens),
                    block_table=np.array(batch.block_table),
                    slot_mapping=np.array(batch.slot_mapping),
                    num_decodes=batch.num_decodes,
                    mirror=mirrored,
                    index=len(record.steps) + len(record.unrun),
                )
            )

        def _run_forward(ids_t, pos_t, batch, order, req_of_token, positions):  # type: ignore[no-untyped-def]
            capture(ids_t, pos_t, batch)
            return run_forward(ids_t, pos_t, batch, order, req_of_token, positions)

        runner.execute_model = execute_model
        runner._run_forward = _run_forward
        fused = runner.fused_decode
        if fused is not None:  # the fused head runs the step without _run_forward
            fused_run = fused.run

            def run(ids_t, pos_t, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
                capture(ids_t, pos_t, batch)
                return fused_run(ids_t, pos_t, batch, *args, **kwargs)

            fused.run = run
        return record

    @property
    def steady_steps(self) -> int:
        return sum(s.steady for s in self.steps)

    def check(self, tokens: dict[str, list[int]]) -> None:
        """``tokens``: each request's prompt and output ids, by request id."""
        blocks: dict[str, list[int]] = {}
        bs = self.block_size
        run = {step.index: step for step in self.steps}
        unrun = iter(self.unrun)
        for n in range(len(self.steps) + len(self.unrun)):
            step = run.get(n)
            so = step.so if step is not None else next(unrun)
            for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
                blocks.pop(req_id, None)
            starts: dict[str, int] = {}
            for new in so.scheduled_new_reqs:
                blocks[new.req_id] = list(new.block_ids)
                starts[new.req_id] = new.num_computed_tokens
            cached = so.scheduled_cached_reqs
            for i, req_id in enumerate(cached.req_ids):
                if i < len(cached.new_block_ids) and cached.new_block_ids[i]:
                    blocks[req_id] += cached.new_block_ids[i]
                starts[req_id] = cached.num_computed_tokens[i]
            if step is None:
                continue
            where = f"step {n} ({'steady' if step.steady else 'general'} path)"
            assert sorted(step.req_ids) == sorted(so.num_scheduled_tokens), where
            expected_q = [so.num_scheduled_tokens[r] for r in step.req_ids]
            assert step.query_lens.tolist() == expected_q, where
            assert step.num_decodes == next(
                (i for i, q in enumerate(expected_q) if q != 1), len(expected_q)
            ), f"{where}: decodes first"
            cu = 0
            for i, req_id in enumerate(step.req_ids):
                start, q = starts[req_id], expected_q[i]
                pos = np.arange(start, start + q)
                own = blocks[req_id]
                rows = slice(cu, cu + q)
                what = f"{where}, request {req_id}"
                assert step.context_lens[i] == start, what
                assert step.positions[rows].tolist() == pos.tolist(), what
                assert step.ids[rows].tolist() == tokens[req_id][start : start + q], what
                slots = [own[p // bs] * bs + p % bs for p in pos]
                assert step.slot_mapping[rows].tolist() == slots, what
                row = step.block_table[i]
                assert row[: len(own)].tolist() == own[: len(row)], what
                assert not row[len(own) :].any(), f"{what}: block-table padding"
                cu += q
            if step.mirror is not None:
                write_pos, after = step.mirror
                decodes = step.context_lens[: step.num_decodes]
                assert write_pos.tolist() == decodes.tolist(), f"{where}: mirror positions"
                assert after.tolist() == (decodes + 1).tolist(), f"{where}: mirror lengths"

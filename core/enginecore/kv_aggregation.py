"""Finished KV transfers of every rank, folded into the one output the scheduler sees.

With tensor or pipeline parallelism each rank's connector moves its own shard of a
request's KV (its heads, its layers), and reports the request in ``finished_sending`` or
``finished_recving`` when *its* part is done, possibly in a later step than a peer. The
scheduler may free or use the blocks only when every rank is done, so a request is
reported once the count of ranks that reported it reaches the world size (vLLM's
``KVOutputAggregator``). Invalid blocks and failures of any rank count at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from enginecore.runner_output import KVConnectorOutput, ModelRunnerOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()
        self._carried: list[KVConnectorOutput] = []  # reports of a step with no output

    def _complete(self, counts: Counter[str], reported: Sequence[set[str]]) -> set[str]:
        done = set()
        for ids in reported:
            for req_id in ids:
                counts[req_id] += 1
                if counts[req_id] == self.world_size:
                    del counts[req_id]
                    done.add(req_id)
        return done

    def merge(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's outputs of every rank -> what the scheduler may act on now."""
        present = [*self._carried, *(o for o in outputs if o is not None)]
        self._carried = []
        if not present:
            return None
        failed = set().union(*(o.failed_recving for o in present))
        for req_id in failed:  # a failed load is final: its peers' reports are moot
            self._recving.pop(req_id, None)
        failures: dict[str, str] = {}
        for o in present:
            for req_id, message in o.failures.items():
                failures.setdefault(req_id, message)
        return KVConnectorOutput(
            finished_sending=self._complete(self._sending, [o.finished_sending for o in present]),
            finished_recving=self._complete(self._recving, [o.finished_recving for o in present]),
            failed_recving=failed,
            invalid_block_ids=set().union(*(o.invalid_block_ids for o in present)),
            failures=failures,
        )

    def merge_outputs(
        self, outputs: Sequence[ModelRunnerOutput | None], output_rank: int
    ) -> ModelRunnerOutput | None:
        """The output rank's ModelRunnerOutput, with every rank's KV transfers folded in."""
        reports = [o.kv_connector_output for o in outputs if o is not None]
        chosen = outputs[output_rank]
        if chosen is None:
            self._carried.extend(r for r in reports if r is not None)
            return None
        chosen.kv_connector_output = self.merge(reports)
        return chosen

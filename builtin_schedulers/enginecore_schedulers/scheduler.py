"""The default scheduler: continuous batching over a paged KV cache.

Each step closes, per request, the gap between ``num_computed_tokens`` and the tokens it
has (prompt + sampled + not-yet-sampled placeholders), within a token budget and a cap
on running requests. Running requests are served first so decodes never starve; waiting
requests are admitted in policy order. When the KV cache is full a running request is
preempted (freed and recomputed later).

Async scheduling needs no separate class: a step that will sample a token adds an
output *placeholder*, and the next ``schedule()`` already feeds that (unknown to us,
known to the worker) token back in. When the output arrives the placeholder is replaced
by the real token. In synchronous use outputs always arrive before the next step, so the
placeholders are back at zero and the behaviour is the plain one.

Decisions depend only on ``seq_no``/``priority`` and token counts, never on wall-clock
time or hash iteration order, so identical engines produce identical outputs.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from enginecore.distributed import resolve_device_type
from enginecore.errors import KV_TRANSFER_ERROR_PREFIX
from enginecore.interfaces import Scheduler, SchedulerState, SchedulingPolicy
from enginecore.lora.modules import preloaded_requests
from enginecore.protocol import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    PromptLogprobs,
    SchedulerStats,
)
from enginecore.request import Request, RequestStatus
from enginecore.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from enginecore_schedulers.block_pool import KVCacheBlock
from enginecore_schedulers.kv_cache_manager import KVCacheManager
from enginecore_schedulers.lora_admission import LoRAAdmission
from enginecore_schedulers.step_share import StepShare
from enginecore_schedulers.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from enginecore.config import EngineConfig
    from enginecore.interfaces import KVConnectorScheduler
    from enginecore.runner_output import KVConnectorOutput, ModelRunnerOutput

logger = logging.getLogger(__name__)

_RUNNING = RequestStatus.RUNNING
_PREEMPTED = RequestStatus.PREEMPTED
_STOPPED = RequestStatus.FINISHED_STOPPED
_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_FINISH_REASON = {s: RequestStatus.finish_reason(s) for s in RequestStatus}
#: The per-client cap's default on CPUs (``scheduler.max_num_seqs_per_client`` unset).
CPU_SEQS_PER_CLIENT = 16
#: Steps the per-client cap holds after the last time several clients had work: a client
#: whose request just finished often sends the next at once (a conversation, a client
#: that sends one request at a time), and should not find a full-size step in flight.
SHARE_HOLD_STEPS = 32


@dataclass
class SpecCounts:
    """Speculative decoding since the last stats: steps with drafts, draft tokens
    verified, draft tokens accepted."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


class DefaultScheduler(Scheduler):
    """Continuous batching, chunked prefill, preemption by recompute, prefix caching."""

    supports_async_scheduling = True
    supports_kv_cache_groups = True

    def __init__(
        self,
        config: EngineConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        policy: SchedulingPolicy,
        kv_connector: KVConnectorScheduler | None = None,
        log_stats: bool = True,
        kv_cache_groups: Sequence[int | None] | None = None,
    ) -> None:
        sched = config.scheduler
        cache = config.cache
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = cache.tokens_per_block
        self.max_num_seqs = sched.max_num_seqs
        self.chunked_prefill = sched.chunked_prefill
        budget = sched.max_num_batched_tokens
        if budget is None:
            budget = 2048 if sched.chunked_prefill else max_model_len
        # Every running request must be able to decode one token per step.
        self.max_num_batched_tokens = max(budget, self.max_num_seqs)
        # A cap on a prefill chunk only makes sense when prompts may be chunked.
        self.long_prefill_token_threshold = (
            sched.long_prefill_token_threshold if sched.chunked_prefill else 0
        )
        self.policy = policy
        self.connector = kv_connector
        self.log_stats = log_stats
        spec = config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec.enabled else 0
        self.kv_cache_manager = KVCacheManager(
            num_blocks,
            cache.tokens_per_block,
            max_model_len,
            enable_caching=cache.prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
            kv_cache_groups=kv_cache_groups,
            num_rollback_tokens=self.num_spec_tokens,
        )
        self._grouped = self.kv_cache_manager.num_groups > 1
        if self._grouped and kv_connector is not None:
            raise ValueError(
                "a KV connector sees one block table: it cannot run with several KV cache "
                f"groups (sliding windows {list(kv_cache_groups or [])})"
            )
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting = WaitingQueue(policy.sort_key)
        # Finished since the last schedule(): the workers drop their state.
        self.finished_req_ids: set[str] = set()
        # Preempted outside schedule() (reset_prefix_cache): reported by the next step.
        self._pending_preempted: set[str] = set()
        # Finished requests whose blocks a KV connector is still saving.
        self._delayed_free: dict[str, Request] = {}
        # KV connector loads in flight (WAITING_FOR_REMOTE_KVS): id -> (request, tokens
        # computed once the load lands); finished ones go back to the waiting queue and
        # are admitted with their blocks (``_remote_ready``).
        self._waiting_for_remote: dict[str, tuple[Request, int]] = {}
        self._remote_ready: set[str] = set()
        # Finished (aborted, failed) while a load was writing their blocks.
        self._aborted_loading: dict[str, Request] = {}
        # Invalid blocks reported for loads not yet reported finished.
        self._load_errors: dict[str, set[int]] = {}
        # Requests a KV connector raised on during schedule(): (client, error output),
        # reported by the next update_from_output.
        self._connector_failed: list[tuple[int, EngineCoreOutput]] = []
        self._num_kv_loaded_tokens_since_stats = 0
        self._num_kv_rejected_since_stats = 0
        self._num_prompt_tokens_computed_since_stats = 0
        self._policy_admits = type(policy).admit is not SchedulingPolicy.admit
        self._step_id = 0
        # Running requests scheduled through the batch-wide decode check of schedule()
        # rather than one allocate_slots each (read by tests that the path is taken).
        self.num_fast_decodes = 0
        # Plain steps update_from_output reported as columns (``plain_output_columns``).
        self.num_plain_outputs = 0
        self._num_preemptions_since_stats = 0
        self._last_num_scheduled_tokens = 0
        # Speculative decoding: draft slots per decode step (0: off), and counters since
        # the last make_stats(): steps with drafts, draft tokens verified, accepted (and
        # accepted by draft position).
        self._spec_counts = SpecCounts()
        self._spec_accepted_per_pos: list[int] = []
        # LoRA: most distinct adapters per step (0: LoRA off), and this step's adapters.
        self.max_loras = config.lora.max_loras if config.lora.enable_lora else 0
        self._step_loras: set[int] = set()
        # Adapters the workers have read: requests wait in the queue until theirs is.
        self.lora_admission = (
            LoRAAdmission(ready=[r.lora_int_id for r in preloaded_requests(config.lora)])
            if self.max_loras
            else None
        )
        # Per-client cap on requests in a step while several clients have work: each
        # request's client (the policy's client_key) and unfinished requests per client.
        self.max_num_seqs_per_client = _seqs_per_client(config)
        self._shared_until_step = 0  # the cap holds until this step
        self.client_of: dict[str, Hashable] = {}
        self.unfinished_per_client: Counter[Hashable] = Counter()

    # --- requests in and out ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens > self.max_model_len:
            # The frontend rejects these; a scheduler must never allocate past the end.
            raise ValueError(
                f"request {request.request_id!r} has a {request.num_prompt_tokens}-token "
                f"prompt, longer than max_model_len={self.max_model_len}"
            )
        # Resolve max_tokens against max_model_len once, so the per-step cap on
        # scheduled tokens is a single addition.
        room = max(self.max_model_len - request.num_prompt_tokens, 1)
        if request.max_tokens is None or request.max_tokens > room:
            request.max_tokens = room
        request.status = RequestStatus.WAITING
        client = self.policy.client_key(request)
        self.requests[request.request_id] = request
        self.client_of[request.request_id] = client
        self.unfinished_per_client[client] += 1
        self.waiting.push(request)
        if self.log_stats:
            request.events.append((EngineCoreEventType.QUEUED, time.monotonic()))

    def finish_requests(
        self, request_ids: str | Iterable[str] | None, finished_status: RequestStatus
    ) -> list[Request]:
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if request_ids is None:
            ids: Iterable[str] = list(self.requests)
        elif isinstance(request_ids, str):
            ids = (request_ids,)
        else:
            ids = request_ids
        finished: list[Request] = []
        from_running = from_waiting = False
        for request_id in ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue  # unknown or already finished: idempotent
            if request.status == _RUNNING:
                from_running = True
            else:
                from_waiting = True
            request.status = finished_status
            self._release(request)
            finished.append(request)
        if finished:
            self._drop_finished(finished, from_running, from_waiting)
        return finished

    def _release(self, request: Request, *, force_free: bool = False) -> None:
        """Forget a finished request: free its blocks unless a connector still saves
        them, or still loads into them (then they are freed when the load reports)."""
        request_id = request.request_id
        del self.requests[request_id]
        client = self.client_of.pop(request_id)
        if self.unfinished_per_client[client] > 1:
            self.unfinished_per_client[client] -= 1
        else:
            del self.unfinished_per_client[client]
        self.finished_req_ids.add(request_id)
        self._remote_ready.discard(request_id)
        loading = self._waiting_for_remote.pop(request_id, None) is not None
        self._load_errors.pop(request_id, None)
        delay_free = False
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(request_id)
            try:
                delay_free, params = self.connector.request_finished(request, block_ids)
            except Exception:
                logger.exception("KV connector request_finished raised for %s", request_id)
                delay_free, params = False, None
            if params is not None:
                request.kv_transfer_params = params
        if loading and not force_free:
            self._aborted_loading[request_id] = request
        elif delay_free and not force_free:
            self._delayed_free[request_id] = request
        else:
            self.kv_cache_manager.free(request)

    def _drop_finished(
        self, finished: list[Request], from_running: bool, from_waiting: bool
    ) -> None:
        """Remove finished requests from the running list and the waiting queue at once."""
        # Identity, not ids: a finished id may already be reused by a new request.
        gone = {id(r) for r in finished}
        if from_running:
            self.running = [r for r in self.running if id(r) not in gone]
        if from_waiting:
            self.waiting.remove_many(gone)

    # --- scheduling ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._step_id += 1
        kv = self.kv_cache_manager
        allocate = kv.allocate_slots
        policy = self.policy
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        running = self.running
        if threshold and len(running) + len(self.waiting) <= 1:
            threshold = 0  # a lone prefill is never capped: nothing competes with it
        num_scheduled: dict[str, int] = {}
        scheduled_running: list[Request] = []
        running_new_blocks: list[Any] = []  # per request: ids, per-group ids, or None
        # The output's rows for scheduled_running, filled as each is scheduled. A fast
        # decode's counters advance right there; the others' (general) in step 3.
        cached = CachedRequestData()
        cached_ids = cached.req_ids
        cached_computed = cached.num_computed_tokens
        general: list[Request] = []
        preempted: list[Request] = []
        spec_tokens: dict[str, list[int]] = {}
        self._step_loras = set()
        # With several clients at work, one client's requests this step are capped.
        if self.max_num_seqs_per_client and len(self.unfinished_per_client) > 1:
            self._shared_until_step = self._step_id + SHARE_HOLD_STEPS
        share = StepShare(self) if self._step_id <= self._shared_until_step else None

        # 1. Running requests first, in running order. A decode step (one token) of a
        # request whose blocks already hold that token is decided for the whole batch at
        # once (``one_more_token_fits``); the rest, and every request of a step with
        # drafts, adapters or a per-client share, take the general path below.
        fits = (
            kv.one_more_token_fits(running)
            if share is None and not self.num_spec_tokens and not self.max_loras
            else None
        )
        num_fast = 0
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            if (
                fits is not None
                and fits[i]
                and len(request.all_token_ids) + request.num_output_placeholders == computed + 1
                and request.num_prompt_tokens + request.max_tokens > computed + 1  # type: ignore[operator]
                and request.sampling_params.structured_output is None
            ):
                i += 1
                scheduled_running.append(request)
                running_new_blocks.append(None)
                request_id = request.request_id
                num_scheduled[request_id] = 1
                cached_ids.append(request_id)
                cached_computed.append(computed)
                request.num_computed_tokens = computed + 1
                request.num_output_placeholders += 1
                budget -= 1
                num_fast += 1
                continue
            i += 1
            num_new = len(request.all_token_ids) + request.num_output_placeholders - computed
            # Never compute the last output token: prompt + max_tokens - 1 in total.
            max_tokens = request.max_tokens
            assert max_tokens is not None  # resolved by the engine against max_model_len
            limit = request.num_prompt_tokens + max_tokens - 1 - computed
            if num_new > limit:
                num_new = limit
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                continue  # waiting for outputs of batches in flight
            if share is not None and share.full(request):
                continue  # its client has its share of this step: it waits its turn
            if self.max_loras and not self._lora_fits(request):
                continue  # max_loras other adapters run this step
            drafts = (
                self._draft_slots(request, num_new, min(limit, budget) - num_new)
                if self.num_spec_tokens
                else ()
            )
            new_blocks = allocate(request, num_new, num_lookahead_tokens=len(drafts))
            while new_blocks is None:
                # Out of blocks: preempt the policy's victim and retry.
                victim = policy.pick_preemption_victim(running)
                fits = None  # indices into ``running`` shift from here on
                index = running.index(victim)
                del running[index]
                if index < i:
                    i -= 1
                if victim.request_id in num_scheduled:
                    # Already scheduled this step: take its tokens back.
                    budget += num_scheduled.pop(victim.request_id)
                    if share is not None:
                        share.give_back(victim)
                    spec_tokens.pop(victim.request_id, None)
                    j = scheduled_running.index(victim)
                    del scheduled_running[j]
                    del running_new_blocks[j]
                    del cached_ids[j]
                    del cached_computed[j]
                    if victim in general:
                        general.remove(victim)
                    else:  # a fast decode: its counters already advanced
                        victim.num_computed_tokens -= 1
                        victim.num_output_placeholders -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = allocate(request, num_new, num_lookahead_tokens=len(drafts))
            if new_blocks is None:
                continue  # the request itself was the victim
            scheduled_running.append(request)
            general.append(request)
            cached_ids.append(request.request_id)
            cached_computed.append(computed)
            if self._grouped:
                by_group = [[b.block_id for b in blocks] for blocks in new_blocks]
                running_new_blocks.append(by_group if any(by_group) else None)
            else:
                running_new_blocks.append([b.block_id for b in new_blocks] if new_blocks else None)
            if drafts:
                spec_tokens[request.request_id] = drafts
                num_new += len(drafts)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if share is not None:
                share.take(request)
        self.num_fast_decodes += num_fast
        if share is not None and share.turned_away:
            # Those that ran go to the back: the ones turned away run first next step.
            running[:] = share.rotate(running, num_scheduled)

        # 2. Waiting requests in policy order; none in a step that had to preempt.
        scheduled_new: list[Request] = []
        if not preempted and self.waiting:
            scheduled_new = self._admit_waiting(budget, threshold, num_scheduled, share)
            for request in scheduled_new:
                budget -= num_scheduled[request.request_id]

        # 3. Build the output and advance the counters of the general path's requests.
        structured: list[str] = []
        for request in general:
            request_id = request.request_id
            computed = request.num_computed_tokens
            if computed < request.num_prompt_tokens:
                self._count_prompt_tokens(request, computed, num_scheduled[request_id])
            computed += num_scheduled[request_id]
            request.num_computed_tokens = computed
            if computed >= len(request.all_token_ids) + request.num_output_placeholders:
                # This step samples a token, plus one per draft it may accept.
                scheduled_drafts = spec_tokens.get(request_id)
                request.num_output_placeholders += (
                    1 + len(scheduled_drafts) if scheduled_drafts else 1
                )
            if request.sampling_params.structured_output is not None:
                structured.append(request_id)
        if self._grouped:
            # The first group's ids where a single table is read; every group's beside.
            cached.new_block_ids = [(ids[0] or None) if ids else None for ids in running_new_blocks]
            cached.new_group_block_ids = running_new_blocks
        else:
            cached.new_block_ids = running_new_blocks

        new_reqs: list[NewRequestData] = []
        now = time.monotonic() if self.log_stats else 0.0
        for request in scheduled_new:
            request_id = request.request_id
            new_reqs.append(
                NewRequestData(
                    req_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    output_token_ids=list(request.output_token_ids),
                    group_block_ids=kv.get_group_block_ids(request_id) if self._grouped else None,
                    lora_request=request.lora_request,
                )
            )
            self._count_prompt_tokens(
                request, request.num_computed_tokens, num_scheduled[request_id]
            )
            computed = request.num_computed_tokens + num_scheduled[request_id]
            request.num_computed_tokens = computed
            if computed >= len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1
            if request.sampling_params.structured_output is not None:
                structured.append(request_id)
            if self.log_stats:
                request.events.append((EngineCoreEventType.SCHEDULED, now))

        preempted_ids = {r.request_id for r in preempted}
        if self._pending_preempted:
            preempted_ids |= self._pending_preempted
            self._pending_preempted = set()
        finished_ids, self.finished_req_ids = self.finished_req_ids, set()
        total = self.max_num_batched_tokens - budget
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens=spec_tokens,
            finished_req_ids=finished_ids,
            preempted_req_ids=preempted_ids,
            structured_output_request_ids=structured,
            step_id=self._step_id,
        )
        if self.lora_admission is not None and self.lora_admission.pending:
            out.lora_loads = self.lora_admission.loads()
        if self.lora_admission is not None and self.lora_admission.removing:
            out.lora_removals = self.lora_admission.removals(self._lora_ids_in_use())
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        self._last_num_scheduled_tokens = total
        self._num_preemptions_since_stats += len(preempted)
        return out

    def _lora_fits(self, request: Request) -> bool:
        """Whether the request's adapter may run this step (at most ``max_loras``
        distinct adapters per step); counts it in when it may."""
        lora = request.lora_request
        if lora is None or lora.lora_int_id in self._step_loras:
            return True
        if len(self._step_loras) >= self.max_loras:
            return False
        self._step_loras.add(lora.lora_int_id)
        return True

    def _lora_ids_in_use(self) -> set[int]:
        """The adapters the requests this scheduler holds name (they finish first)."""
        return {
            r.lora_request.lora_int_id
            for r in itertools.chain(self.running, self.waiting.view())
            if r.lora_request is not None
        }

    def _fail_lora_reads(self, failed: dict[int, str]) -> None:
        """Fail the waiting requests naming an adapter the workers could not read (the
        error is reported by this update); nothing else is touched."""
        if not failed:
            return
        victims = [
            r
            for r in self.waiting.view()
            if r.lora_request is not None and r.lora_request.lora_int_id in failed
        ]
        for request in self.finish_requests(
            [r.request_id for r in victims], RequestStatus.FINISHED_ERROR
        ):
            assert request.lora_request is not None
            output = EngineCoreOutput(
                request_id=request.request_id,
                new_token_ids=[],
                finish_reason=_FINISH_REASON[RequestStatus.FINISHED_ERROR],
                error=failed[request.lora_request.lora_int_id],
            )
            self._connector_failed.append((request.client_index, output))

    def _count_prompt_tokens(self, request: Request, computed: int, num_new: int) -> None:
        """Prompt tokens this step computes (not taken from a cache or a connector)."""
        end = min(computed + num_new, request.num_prompt_tokens)
        if end > computed:
            self._num_prompt_tokens_computed_since_stats += end - computed

    def _draft_slots(self, request: Request, num_new: int, room: int) -> list[int]:
        """Draft tokens to verify after a decode step's one token, at most ``room``.

        With no batch of the request in flight we know its latest drafts (sent back with
        its last output). Otherwise its newest tokens are still unknown to us, and so are
        the drafts the worker proposed from them: we send ``-1`` placeholders for
        ``num_speculative_tokens`` drafts, and the worker fills in its own (it may verify
        fewer; ``update_from_output`` rolls back what was not accepted).
        """
        if room <= 0 or num_new != 1 or request.sampling_params.structured_output is not None:
            return []
        placeholders = request.num_output_placeholders
        if request.num_output_tokens + placeholders == 0:
            return []  # the prompt's last token: nothing was sampled yet to draft from
        if request.num_computed_tokens + 1 != len(request.all_token_ids) + placeholders:
            return []  # recomputing after a preemption: not a decode step
        if placeholders:
            return [-1] * min(self.num_spec_tokens, room)
        return request.spec_token_ids[: min(self.num_spec_tokens, room)]

    def _admit_waiting(
        self,
        budget: int,
        threshold: int,
        num_scheduled: dict[str, int],
        share: StepShare | None = None,
    ) -> list[Request]:
        """Admit waiting requests while budget, ``max_num_seqs`` and blocks allow."""
        kv = self.kv_cache_manager
        waiting = self.waiting
        running = self.running
        admitted: list[Request] = []
        skipped: list[Request] = []
        if share is not None:
            share.count_waiting(self.running)
        while waiting and budget > 0:
            if share is not None and not share.admissible:
                break  # every client with waiting requests has its share of this step
            if len(running) >= self.max_num_seqs and (
                share is None or not self._free_a_seat(share, num_scheduled)
            ):
                break
            request = waiting.peek()
            if share is not None and share.full(request):
                skipped.append(waiting.pop())  # behind another client's turn
                continue
            if request.num_output_placeholders:
                # Preempted while a batch holding it was in flight: resume only once that
                # output has arrived, or the same position would be sampled twice.
                break
            if self._policy_admits and not self.policy.admit(request, self._state(budget)):
                skipped.append(waiting.pop())
                continue
            if self.max_loras:
                assert self.lora_admission is not None
                if not self.lora_admission.is_ready(request.lora_request):
                    skipped.append(waiting.pop())  # its adapter is being read
                    continue
                if not self._lora_fits(request):
                    skipped.append(waiting.pop())  # its adapter waits for a free slot
                    continue
            if request.request_id in self._remote_ready:
                # Its external KV has landed in the blocks it holds: compute the rest.
                num_new = request.num_tokens - request.num_computed_tokens
                if 0 < threshold < num_new:
                    num_new = threshold
                if num_new > budget:
                    if not self.chunked_prefill:
                        break
                    num_new = budget
                if kv.allocate_slots(request, num_new) is None:
                    break
                waiting.pop()
                self._remote_ready.discard(request.request_id)
                request.status = _RUNNING
                running.append(request)
                admitted.append(request)
                num_scheduled[request.request_id] = num_new
                budget -= num_new
                if share is not None:
                    share.admit(request)
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_external = 0
            if self.connector is not None:
                try:
                    matched, load_async = self.connector.get_num_new_matched_tokens(
                        request, num_hit
                    )
                except Exception as exc:
                    self._fail_in_connector(waiting.pop(), exc)
                    continue
                if matched is None:
                    break  # the connector asks us to retry later; keep the order strict
                num_external = matched
            if num_hit + num_external >= request.num_tokens:
                # Like a local hit: the last token is always computed, for its logits.
                num_external = max(request.num_tokens - 1 - num_hit, 0)
            if num_external and load_async:
                if not self._start_remote_load(request, num_hit, hit_blocks, num_external):
                    break  # no blocks for it yet
                continue
            num_new = request.num_tokens - num_hit - num_external
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                if not self.chunked_prefill:
                    break  # it does not fit whole: it blocks the queue (strict order)
                num_new = budget
            new_blocks = kv.allocate_slots(request, num_new + num_external, num_hit, hit_blocks)
            if new_blocks is None:
                break  # no preemption for admission: wait for blocks to free up
            waiting.pop()
            if self.connector is not None:
                request.num_computed_tokens = num_hit
                try:
                    self.connector.update_state_after_alloc(
                        request, kv.get_block_ids(request.request_id), num_external
                    )
                except Exception as exc:
                    self._fail_in_connector(request, exc)
                    continue
                self._num_kv_loaded_tokens_since_stats += num_external
            request.status = _RUNNING
            request.num_computed_tokens = num_hit + num_external
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit + num_external
            running.append(request)
            admitted.append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            if share is not None:
                share.admit(request)
        for request in skipped:
            waiting.push(request)
        return admitted

    def _free_a_seat(self, share: StepShare, num_scheduled: dict[str, int]) -> bool:
        """Every seat (``max_num_seqs``) is taken while another client waits: preempt one
        request of the client holding the most seats, if beyond an equal share, among
        those that did not run this step. That client admits nothing more this step."""
        client_of = self.client_of
        held = Counter(client_of[r.request_id] for r in self.running)
        client, seats = held.most_common(1)[0]
        if seats <= self.max_num_seqs // len(self.unfinished_per_client):
            return False
        if not share.others_waiting(client):
            return False
        idle = [
            r
            for r in self.running
            if client_of[r.request_id] == client and r.request_id not in num_scheduled
        ]
        if not idle:
            return False
        victim = self.policy.pick_preemption_victim(idle)
        self.running.remove(victim)
        self._preempt(victim)
        self._pending_preempted.add(victim.request_id)
        self._num_preemptions_since_stats += 1
        share.close(client)
        return True

    def _start_remote_load(
        self,
        request: Request,
        num_hit: int,
        hit_blocks: list[KVCacheBlock] | list[list[KVCacheBlock]],
        num_external: int,
    ) -> bool:
        """Give the request blocks for its prefix hit and the external tokens, then park
        it in WAITING_FOR_REMOTE_KVS until the worker reports the load finished."""
        kv = self.kv_cache_manager
        # Unhashed until the load lands: nobody may share blocks still being written.
        if kv.allocate_slots(request, num_external, num_hit, hit_blocks, cache=False) is None:
            return False
        self.waiting.pop()
        request.num_computed_tokens = num_hit
        try:
            # Remote KV is only loaded with a connector.
            connector = self.connector
            if connector is None:
                raise RuntimeError("remote KV is loaded only with a KV connector")
            connector.update_state_after_alloc(
                request, kv.get_block_ids(request.request_id), num_external
            )
        except Exception as exc:
            self._fail_in_connector(request, exc)
            return True
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._waiting_for_remote[request.request_id] = (request, num_hit + num_external)
        return True

    def _fail_in_connector(self, request: Request, exc: Exception) -> None:
        """A connector that raises on one request (already out of the waiting queue)
        fails that request only; the error is reported by the next update."""
        message = f"{type(exc).__name__}: {exc}"
        logger.error("request %s failed in the KV connector: %s", request.request_id, message)
        request.status = RequestStatus.FINISHED_ERROR
        self._release(request, force_free=True)
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=_FINISH_REASON[RequestStatus.FINISHED_ERROR],
            error=f"{KV_TRANSFER_ERROR_PREFIX}{self.config.kv_transfer.connector!r}: {message}",
        )
        self._connector_failed.append((request.client_index, output))

    def _state(self, budget: int) -> SchedulerState:
        kv = self.kv_cache_manager
        return SchedulerState(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_free_blocks=kv.get_num_free_blocks(),
            num_total_blocks=kv.block_pool.num_usable_blocks,
            token_budget_left=budget,
            step=self._step_id,
            running=tuple(self.running),
            waiting=self.waiting.view(),
        )

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it for recomputation."""
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.push(request)
        if self.log_stats:
            request.events.append((EngineCoreEventType.PREEMPTED, time.monotonic()))

    # --- outputs ---------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        requests = self.requests
        sampled_rows = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        max_model_len = self.max_model_len
        per_client: dict[int, list[EngineCoreOutput]] = {}
        finished: list[Request] = []
        from_running = from_waiting = False
        connector_output = runner_output.kv_connector_output
        if self.lora_admission is not None and runner_output.lora_report is not None:
            self._fail_lora_reads(self.lora_admission.apply(runner_output.lora_report))
        for client, failed_output in self._connector_failed:
            per_client.setdefault(client, []).append(failed_output)
        self._connector_failed = []
        recomputed: set[str] = set()
        if connector_output is not None and self.connector is not None:
            recomputed = self._apply_connector_output(connector_output, per_client)
        spec_slots = scheduler_output.scheduled_spec_decode_tokens
        new_drafts = runner_output.draft_token_ids
        spec_counts = self._spec_counts
        # Plain steps (one token that finishes nothing, nothing else to report) as
        # columns per client, where the engine asked for them and the step has no
        # drafts, prompt logprobs, pooling or recomputation to report.
        plain_rows: dict[int, tuple[list[str], list[int]]] | None = (
            {}
            if self.plain_output_columns
            and not spec_slots
            and new_drafts is None
            and not recomputed
            and not runner_output.prompt_logprobs
            and not runner_output.pooler_output
            else None
        )
        num_plain = 0
        for index, request_id in enumerate(runner_output.req_ids):
            sampled = sampled_rows[index]
            if not sampled:
                continue  # a partial prefill chunk samples nothing
            request = requests.get(request_id)
            if request is None or request.num_output_placeholders <= 0:
                continue  # finished or aborted while its batch was in flight
            if (
                plain_rows is not None
                and len(sampled) == 1
                and not request.events
                and request.output_token_ids  # a first token reports num_cached_tokens
            ):
                params = request.sampling_params
                token = sampled[0]
                output_ids = request.output_token_ids
                all_ids = request.all_token_ids
                stop_ids = params.stop_token_ids
                if (
                    params.logprobs is None
                    and params.structured_output is None
                    and (params.ignore_eos or token != request.eos_token_id)
                    and not (stop_ids and token in stop_ids)
                    and len(all_ids) + 1 < max_model_len
                    and len(output_ids) + 1 < request.max_tokens  # type: ignore[operator]
                ):
                    placeholders = request.num_output_placeholders - 1
                    request.num_output_placeholders = placeholders if placeholders > 0 else 0
                    output_ids.append(token)
                    all_ids.append(token)
                    columns = plain_rows.get(request.client_index)
                    if columns is None:
                        columns = plain_rows[request.client_index] = ([], [])
                    columns[0].append(request_id)
                    columns[1].append(token)
                    num_plain += 1
                    continue
            slots = spec_slots.get(request_id) if spec_slots else None
            num_slots = len(slots) if slots else 0
            if request_id in recomputed:
                # Its step read KV that failed validation: drop the token, recompute.
                request.num_output_placeholders = max(
                    request.num_output_placeholders - 1 - num_slots, 0
                )
                continue
            placeholders = request.num_output_placeholders - 1 - num_slots
            request.num_output_placeholders = placeholders if placeholders > 0 else 0
            if num_slots:
                num_accepted = len(sampled) - 1
                if request.status == _RUNNING:
                    # Roll back the rejected draft slots (their KV is overwritten later).
                    request.num_computed_tokens -= num_slots - num_accepted
                verified = runner_output.num_draft_tokens
                num_verified = verified[index] if verified is not None else num_slots
                if num_verified:
                    spec_counts.drafts += 1
                    spec_counts.draft_tokens += num_verified
                    spec_counts.accepted_tokens += num_accepted
                    per_pos = self._spec_accepted_per_pos
                    per_pos.extend([0] * (num_accepted - len(per_pos)))
                    for position in range(num_accepted):
                        per_pos[position] += 1
            if new_drafts is not None:
                request.spec_token_ids = new_drafts[index]
            params = request.sampling_params
            output_ids = request.output_token_ids
            all_ids = request.all_token_ids
            eos = None if params.ignore_eos else request.eos_token_id
            stop_ids = params.stop_token_ids
            max_tokens = request.max_tokens
            assert max_tokens is not None  # resolved by the engine against max_model_len
            status: RequestStatus | None = None
            num_taken = 0
            # Stop checks in order: EOS, stop token, length. EOS and stop tokens win even
            # below min_tokens: a logits mask upstream keeps them from being sampled.
            for token in sampled:
                output_ids.append(token)
                all_ids.append(token)
                num_taken += 1
                if token == eos:
                    status = _STOPPED
                    break
                if stop_ids and token in stop_ids:
                    status = _STOPPED
                    request.stop_reason = token
                    break
                if len(all_ids) >= max_model_len or len(output_ids) >= max_tokens:
                    status = _LENGTH_CAPPED
                    break
            output = EngineCoreOutput(
                request_id=request_id,
                new_token_ids=sampled if num_taken == len(sampled) else sampled[:num_taken],
                num_cached_tokens=request.num_cached_tokens if request.num_cached_tokens > 0 else 0,
            )
            if logprobs is not None and params.logprobs is not None:
                cu = logprobs.cu_num_generated_tokens
                rows = slice(cu[index], cu[index] + num_taken) if cu else slice(index, index + 1)
                output.new_logprob_token_ids = logprobs.logprob_token_ids[rows]
                output.new_logprobs = logprobs.logprobs[rows]
                output.new_sampled_ranks = logprobs.sampled_token_ranks[rows]
            if runner_output.prompt_logprobs and request_id in runner_output.prompt_logprobs:
                lp = runner_output.prompt_logprobs[request_id]
                output.prompt_logprobs = PromptLogprobs(
                    lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks
                )
            pooled = runner_output.pooler_output
            if pooled and request_id in pooled:
                output.pooling_output = pooled[request_id]
                output.new_token_ids = []  # the placeholder token is not an output
            if request.events:
                output.events = request.events
                request.events = []
            if status is not None:
                if request.status == _RUNNING:
                    from_running = True
                else:
                    from_waiting = True  # preempted: an in-flight output stopped it
                request.status = status
                output.finish_reason = _FINISH_REASON[status]
                output.stop_reason = request.stop_reason
                self._release(request)
                if request.kv_transfer_params is not None:
                    output.kv_transfer_params = request.kv_transfer_params
                finished.append(request)
            client_outputs = per_client.get(request.client_index)
            if client_outputs is None:
                per_client[request.client_index] = [output]
            else:
                client_outputs.append(output)
        if finished:
            self._drop_finished(finished, from_running, from_waiting)
        if connector_output is not None and self._delayed_free:
            for request_id in sorted(connector_output.finished_sending):
                request = self._delayed_free.pop(request_id, None)
                if request is not None:
                    self.kv_cache_manager.free(request)
        result = {
            client: EngineCoreOutputs(outputs=outputs) for client, outputs in per_client.items()
        }
        if num_plain:
            assert plain_rows is not None
            self.num_plain_outputs += num_plain
            for client, (plain_ids, plain_tokens) in plain_rows.items():
                client_result = result.get(client)
                if client_result is None:
                    client_result = result[client] = EngineCoreOutputs()
                client_result.plain_req_ids = plain_ids
                client_result.plain_token_ids = plain_tokens
        return result

    def _apply_connector_output(
        self, out: KVConnectorOutput, per_client: dict[int, list[EngineCoreOutput]]
    ) -> set[str]:
        """Failed transfers fail their request; finished loads resume theirs, recomputing
        from the first invalid block. Returns running requests that must be recomputed
        (a synchronous load into them was invalid)."""
        if self.connector is None:
            raise RuntimeError("KV connector output arrived without a KV connector")
        self.connector.update_connector_output(out)
        self._num_kv_rejected_since_stats += out.num_rejected_messages
        kv = self.kv_cache_manager
        bs = self.block_size
        invalid = out.invalid_block_ids
        if invalid:
            kv.uncache_blocks(invalid)
        failed: list[Request] = []
        for request_id, message in sorted(out.failures.items()):
            request = self.requests.get(request_id)
            if request is None:
                aborted = self._aborted_loading.pop(request_id, None)
                if aborted is not None:
                    kv.free(aborted)
                continue
            logger.error("request %s failed in the KV connector: %s", request_id, message)
            request.status = RequestStatus.FINISHED_ERROR
            self._release(request, force_free=True)
            failed.append(request)
            per_client.setdefault(request.client_index, []).append(
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason=_FINISH_REASON[RequestStatus.FINISHED_ERROR],
                    error=f"{KV_TRANSFER_ERROR_PREFIX}{self.config.kv_transfer.connector!r}: "
                    f"{message}",
                )
            )
        if failed:
            self._drop_finished(failed, True, True)
        if invalid:
            for request_id in self._waiting_for_remote:
                bad = invalid.intersection(kv.get_block_ids(request_id))
                if bad:
                    self._load_errors.setdefault(request_id, set()).update(bad)
        for request_id in sorted(out.finished_recving | out.failed_recving):
            aborted = self._aborted_loading.pop(request_id, None)
            if aborted is not None:
                kv.free(aborted)
                continue
            entry = self._waiting_for_remote.pop(request_id, None)
            if entry is None:
                continue
            request, num_loaded = entry
            load_errors = self._load_errors.pop(request_id, None)
            if request_id in out.failed_recving:
                num_loaded = request.num_computed_tokens  # nothing landed: recompute
            elif load_errors:
                block_ids = kv.get_block_ids(request_id)
                for i in range(request.num_computed_tokens // bs, num_loaded // bs):
                    if block_ids[i] in load_errors:
                        num_loaded = i * bs  # recompute from the first invalid block
                        break
            self._num_kv_loaded_tokens_since_stats += num_loaded - request.num_computed_tokens
            request.num_computed_tokens = num_loaded
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_loaded
            kv.cache_blocks(request, num_loaded)
            request.status = RequestStatus.WAITING
            self._remote_ready.add(request_id)
            self.waiting.push(request)
        recomputed: set[str] = set()
        if invalid:
            for request in list(self.running):
                if invalid.intersection(kv.get_block_ids(request.request_id)):
                    self.running.remove(request)
                    self._preempt(request)
                    self._pending_preempted.add(request.request_id)
                    recomputed.add(request.request_id)
        return recomputed

    # --- queries and maintenance -----------------------------------------------------

    def has_requests(self) -> bool:
        # Blocks still held for a connector need steps: the workers report their end.
        return bool(
            self.requests
            or self.finished_req_ids
            or self._delayed_free
            or self._aborted_loading
            # Adapter reads asked for (a run-time load with no request yet) need steps.
            or (self.lora_admission is not None and self.lora_admission.pending)
        )

    def loading_remote_ids(self) -> Iterable[str]:
        """Requests parked while a KV connector loads their blocks."""
        return self._waiting_for_remote.keys()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids)

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting) + len(self._waiting_for_remote)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Drop every cached hash. Fails while requests hold blocks, unless asked to
        preempt every running request first (they are recomputed later)."""
        if reset_running_requests and self.running:
            for request in reversed(self.running):
                self._preempt(request)
                self._pending_preempted.add(request.request_id)
            self._num_preemptions_since_stats += len(self.running)
            self.running = []
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats | None:
        if not self.log_stats:
            return None
        kv = self.kv_cache_manager
        prefix = kv.make_prefix_cache_stats()
        stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self._waiting_for_remote),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self._num_preemptions_since_stats,
            step_counter=self._step_id,
            num_scheduled_tokens=self._last_num_scheduled_tokens,
            num_kv_loaded_tokens=self._num_kv_loaded_tokens_since_stats,
            num_prompt_tokens_computed=self._num_prompt_tokens_computed_since_stats,
            num_waiting_for_remote_kvs=len(self._waiting_for_remote),
            spec_num_drafts=self._spec_counts.drafts,
            spec_num_draft_tokens=self._spec_counts.draft_tokens,
            spec_num_accepted_tokens=self._spec_counts.accepted_tokens,
            spec_num_accepted_tokens_per_pos=self._spec_accepted_per_pos,
            num_kv_rejected_messages=self._num_kv_rejected_since_stats,
        )
        if self.max_loras:
            stats.running_lora_adapters = _count_adapters(self.running)
            stats.waiting_lora_adapters = _count_adapters(self.waiting.view())
        self._num_kv_rejected_since_stats = 0
        self._num_preemptions_since_stats = 0
        self._num_kv_loaded_tokens_since_stats = 0
        self._num_prompt_tokens_computed_since_stats = 0
        self._spec_counts = SpecCounts()
        self._spec_accepted_per_pos = []
        return stats

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()

    def leak_report(self) -> list[str]:
        """Empty when no request state is left and every KV block is free or cached."""
        problems: list[str] = []
        for name, value in (
            ("requests", self.requests),
            ("running", self.running),
            ("waiting", list(self.waiting)),
            ("unreported finished ids", self.finished_req_ids),
            ("delayed frees", self._delayed_free),
            ("waiting for remote KV", self._waiting_for_remote),
            ("aborted while loading", self._aborted_loading),
            ("load errors", self._load_errors),
            ("clients of requests", self.client_of),
        ):
            if value:
                problems.append(f"{name} not empty: {sorted(_ids(value))[:20]}")
        return problems + self.kv_cache_manager.leak_report()


def _seqs_per_client(config: EngineConfig) -> int:
    """``max_num_seqs_per_client``, resolved: unset, 16 on CPUs and off on GPUs, whose
    decode steps are memory-bound (a step's time grows little with its size, so the cap
    would cost the capped client throughput without shortening anyone's steps)."""
    cap = config.scheduler.max_num_seqs_per_client
    if cap is not None:
        return cap
    return CPU_SEQS_PER_CLIENT if resolve_device_type(config.model.device) == "cpu" else 0


def _ids(items: Any) -> list[str]:
    if isinstance(items, dict):
        return list(items)
    return [getattr(x, "request_id", x) for x in items]


def _count_adapters(requests: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for request in requests:
        if request.lora_request is not None:
            name = request.lora_request.lora_name
            counts[name] = counts.get(name, 0) + 1
    return counts

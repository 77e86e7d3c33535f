"""A stand-in for AsyncLLM after its engine core died: the HTTP app in-process needs no model."""

from __future__ import annotations

from enginecore.errors import EngineDeadError


class _DeadClient:
    def pending_sends(self) -> int:
        return 0


class DeadEngine:
    """What AsyncLLM looks like once its engine core has died."""

    max_model_len = 128
    tokenizer = None
    components: dict = {}
    collectors: dict = {}
    engine_client = _DeadClient()

    async def check_health(self) -> None:
        raise EngineDeadError("the engine core died: worker 0 exited with code -9")

    def add_request(self, *args, **kwargs):
        raise EngineDeadError("the engine core died: worker 0 exited with code -9")

    def abort(self, request_ids) -> None:
        pass

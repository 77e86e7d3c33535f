"""Frontend input processing: prompts -> validated EngineCoreRequests."""

from __future__ import annotations

import json
import pathlib
import time
from typing import TYPE_CHECKING, Any

from enginecore.config import EngineConfig
from enginecore.errors import InvalidRequestError
from enginecore.kv_transfer_params import KVTransferParamsValidator
from enginecore.lora.adapter import check_adapter
from enginecore.lora.modules import lora_module_requests
from enginecore.lora_request import LoRARequest
from enginecore.params import SamplingParams
from enginecore.protocol import EngineCoreRequest
from enginecore.structured_output.validation import StructuredOutputValidator

if TYPE_CHECKING:
    from enginecore.plugins import PluginHost

PromptType = str | dict[str, Any] | list[int]


def generation_eos_ids(config: EngineConfig, tokenizer: Any) -> list[int]:
    """EOS ids: the tokenizer's, plus any the checkpoint's generation_config.json lists."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    path = pathlib.Path(config.model.path)
    gen_config = (path if path.is_dir() else path.parent) / "generation_config.json"
    if gen_config.is_file():
        eos = json.loads(gen_config.read_text()).get("eos_token_id")
        for token_id in eos if isinstance(eos, list) else [eos]:
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids


class InputProcessor:
    """Tokenizes and validates; every error is raised before anything is scheduled."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any,
        max_model_len: int,
        plugins: PluginHost | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = generation_eos_ids(config, tokenizer)
        self.vocab_size = len(tokenizer) if tokenizer is not None else None
        self.structured_output = StructuredOutputValidator(config, plugins)
        self._checked_loras: set[tuple[int, str]] = set()
        self._lora_modules = {r.lora_int_id: r for r in lora_module_requests(config.lora)}
        self.kv_transfer_params = KVTransferParamsValidator(config, plugins)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise InvalidRequestError(
                "a dict prompt needs 'prompt' (text) or 'prompt_token_ids' (a list of ints)"
            )
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(
            f"a prompt is a str, a list of token ids or a dict with 'prompt' or "
            f"'prompt_token_ids'; got {type(prompt).__name__}"
        )

    def check_task(self, params: SamplingParams) -> None:
        """A pooling model serves only pooling requests, a generation model only text."""
        pooling_model = self.config.model.is_pooling
        if pooling_model and params.pooling is None:
            raise InvalidRequestError(
                "this model serves embeddings (runner 'pooling'), not text generation: use "
                "/v1/embeddings, /pooling, /score or /rerank (LLM.embed, LLM.score)"
            )
        if not pooling_model and params.pooling is not None:
            raise InvalidRequestError(
                "this model generates text; embeddings need an engine started with "
                "--runner pooling (or --task embed)"
            )

    def validate_tokens(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            # vLLM's words: its clients match on them.
            raise InvalidRequestError(
                "Either prompt or prompt_embeds must be provided and non-empty."
            )
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but max_model_len is "
                f"{self.max_model_len}: it must be shorter to leave room for output"
            )
        if self.vocab_size is not None:
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"Token id {bad[0]} is out of vocabulary (prompt token ids {bad[:5]} are "
                    f"outside the vocabulary [0, {self.vocab_size}))"
                )
            listed = [t for t in params.logprob_token_ids or () if t >= self.vocab_size]
            if listed:  # vLLM's words
                raise InvalidRequestError(
                    f"token_id(s) {listed[:20]} in logprob_token_ids contain out-of-vocab "
                    f"token ids. Vocabulary size: {self.vocab_size}"
                )

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        if lora_request is not None:
            self.check_lora(lora_request)
        self.check_task(params)
        text, token_ids = self.tokenize(prompt)
        self.validate_tokens(token_ids, params)
        if params.structured_output is not None:
            self.structured_output.validate(params.structured_output)
        self.kv_transfer_params.validate(params.kv_transfer_params)
        room = self.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if params.pooling is not None:
            max_tokens = 1  # a pooling request finishes with its prompt
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in self.eos_ids[1:] if t not in stop_ids]
        all_stop = [*self.eos_ids[:1], *stop_ids] if not params.ignore_eos else stop_ids
        params = params.clone(stop_token_ids=stop_ids or None, all_stop_token_ids=all_stop or None)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            eos_token_id=self.eos_ids[0] if self.eos_ids else None,
            priority=priority,
            cache_salt=cache_salt,
            max_tokens=max_tokens,
            lora_request=lora_request,
        )
        return request, text

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Refuse an adapter the engine cannot serve before anything is queued (its
        config and tensor names are read once per id and path)."""
        lora = self.config.lora
        if not lora.enable_lora:
            raise InvalidRequestError(
                f"request names LoRA adapter {lora_request.lora_name!r} but LoRA is off: "
                "start the engine with enable_lora (--enable-lora)"
            )
        module = self._lora_modules.get(lora_request.lora_int_id)
        if module is not None and module.lora_path != lora_request.lora_path:
            # The workers hold the start-up adapter under this id: it would be served.
            raise InvalidRequestError(
                f"LoRA adapter {lora_request.lora_name!r}: lora_int_id "
                f"{lora_request.lora_int_id} is the --lora-modules adapter "
                f"{module.lora_name!r} ({module.lora_path}); give another id"
            )
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key not in self._checked_loras:
            check_adapter(lora_request.lora_path, lora.max_lora_rank)
            self._checked_loras.add(key)

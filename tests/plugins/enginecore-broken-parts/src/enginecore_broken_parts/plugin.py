"""Each component here fails in one way; ``ping`` works. Nothing is selected unless a
config names it, so an engine with the default config must not notice any of them.

Every kind of the hook table has at least one broken entry: a registration the engine
could never use (dropped when added), a component that raises while it starts, and, where
the kind runs per step or per request, one that raises or hangs at run time or returns
the wrong shapes."""

import sys
import threading

import enginecore
from enginecore.interfaces import (
    KVConnectorFactory,
    KVConnectorScheduler,
    KVConnectorWorker,
    SchedulingPolicy,
    StatLogger,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from enginecore.layers import UnquantizedLinearMethod
from enginecore.layers.torch_attention import TorchAttentionBackend
from enginecore.reasoning_parsers import ThinkTagReasoningParser
from enginecore.tool_parsers import ToolParser
from enginecore_executors.uniproc import UniProcExecutor
from enginecore_models.model_runner import TorchModelRunner
from enginecore_models.models.llama import LlamaForCausalLM
from enginecore_schedulers.scheduler import DefaultScheduler

plugin_api_versions = ">=1.0,<2"


class NotALinear:
    """A plain class registered as a linear method: no priority, no apply."""


class RaisingLinear(UnquantizedLinearMethod):
    def __init__(self, config=None):
        raise RuntimeError("int8 tables missing")


class RaisingAttention(TorchAttentionBackend):
    def __init__(self, spec):
        raise RuntimeError("kernel library not found")


class WrongShapeAttention(TorchAttentionBackend):
    def forward(self, layer, query, key, value, kv_cache, metadata):
        out = super().forward(layer, query, key, value, kv_cache, metadata)
        return out[:, :1]  # drops every head but the first


class HangingAttention(TorchAttentionBackend):
    def forward(self, layer, query, key, value, kv_cache, metadata):
        threading.Event().wait()  # holds the worker's forward pass for good


class WrongShapeLinear(UnquantizedLinearMethod):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x, bias)[..., :-1]


class HangingPrepareLinear(UnquantizedLinearMethod):
    def process_weights_after_loading(self, layer):
        threading.Event().wait()


class RaisingConnectorFactory:
    def scheduler_side(self, config):
        raise RuntimeError("storage bucket unreachable")

    def worker_side(self, config, rank):
        raise RuntimeError("unreachable")


class LoadEveryStepScheduler(KVConnectorScheduler):
    """Finds nothing to load, but asks the worker to load on every step."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return {"load": True}

    def request_finished(self, request, block_ids):
        return False, None


class HangingLoadWorker(KVConnectorWorker):
    def start_load_kv(self, metadata):
        if metadata:
            threading.Event().wait()  # a load that never ends

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, metadata):
        pass

    def wait_for_save(self):
        pass

    def get_finished(self, finished_req_ids):
        return set(), set()


class HangingLoadConnector(KVConnectorFactory):
    def scheduler_side(self, config):
        return LoadEveryStepScheduler()

    def worker_side(self, config, rank):
        return HangingLoadWorker()


class RaisingLoadWorker(HangingLoadWorker):
    def start_load_kv(self, metadata):
        if metadata:
            raise RuntimeError("remote cache returned a short read")


class RaisingLoadConnector(KVConnectorFactory):
    def scheduler_side(self, config):
        return LoadEveryStepScheduler()

    def worker_side(self, config, rank):
        return RaisingLoadWorker()


class WorkerRaisingConnector(KVConnectorFactory):
    def scheduler_side(self, config):
        return LoadEveryStepScheduler()

    def worker_side(self, config, rank):
        raise RuntimeError("no route to the cache server")


class UnorderablePolicy(SchedulingPolicy):
    def sort_key(self, request):
        return object()  # two of them cannot be compared


class HangingPolicy(SchedulingPolicy):
    def sort_key(self, request):
        threading.Event().wait()  # holds the engine loop for good


# --- hanging at run time, in the engine: each built on a working built-in -------------


class HangingScheduler(DefaultScheduler):
    def schedule(self):
        if self.waiting or self.running:  # the first step with work to do never ends
            threading.Event().wait()
        return super().schedule()


class HangingExecutor(UniProcExecutor):
    def execute_model(self, scheduler_output, non_block=False):
        threading.Event().wait()


class HangingRunner(TorchModelRunner):
    def execute_model(self, scheduler_output):
        threading.Event().wait()


class HangingForCausalLM(LlamaForCausalLM):
    """Serves the first forward pass (the start-up's profiling run on a GPU; on a CPU,
    which profiles nothing, the prompt's step), then hangs. Its decode steps reach this
    forward only because the CPU's fused decode step does not stand in for a subclass's."""

    def forward(self, *args, **kwargs):
        if getattr(self, "profiled", False):
            threading.Event().wait()
        self.profiled = True
        return super().forward(*args, **kwargs)


class HangingProposer:
    def __init__(self, config):
        pass

    def propose(self, token_ids, max_num_drafts):
        threading.Event().wait()


# --- returning the wrong shapes at run time ---------------------------------------------


class LongDraftsProposer:
    """Proposes more drafts than it was asked for."""

    def __init__(self, config):
        pass

    def propose(self, token_ids, max_num_drafts):
        return [int(t) for t in token_ids[-1:]] * (max_num_drafts + 2)


class FloatDraftsProposer(LongDraftsProposer):
    """Proposes probabilities where token ids belong."""

    def propose(self, token_ids, max_num_drafts):
        return [0.5] * max_num_drafts


class NoTokenGrammar(StructuredOutputGrammar):
    """Clears its row: no token is ever allowed."""

    def accept_tokens(self, token_ids):
        return True

    def rollback(self, num_tokens):
        pass

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0

    def is_terminated(self):
        return False


class NoTokenGrammarBackend(StructuredOutputBackend):
    def compile(self, spec):
        return spec

    def new_grammar(self, compiled):
        return NoTokenGrammar()


# --- raising while it starts, for the kinds built only when selected --------------------


class RaisingScheduler:
    """Fails when the engine core builds it."""

    def __init__(self, config, **kwargs):
        raise RuntimeError("scheduler state file corrupt")


class RaisingPolicy(SchedulingPolicy):
    def __init__(self, config):
        raise RuntimeError("tenant weights missing")

    def sort_key(self, request):
        return 0


class RaisingExecutor:
    def __init__(self, config, worker_spec):
        raise RuntimeError("cluster manager refused the job")


class RaisingRunner:
    def __init__(self, config, worker_spec, device, parallel):
        raise RuntimeError("runner needs a device it cannot find")


def raising_model(hf_config, parallel, dtype):
    raise RuntimeError("weights layout unknown")


class RaisingStatLogger(StatLogger):
    def __init__(self, config, engine_index=0):
        raise RuntimeError("metrics sink unreachable")

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        pass


class RaisingProposer:
    def __init__(self, config):
        raise RuntimeError("draft tables missing")

    def propose(self, token_ids, max_num_drafts):
        return []


class RaisingGrammarBackend:
    """Built the first time a request carries a constraint."""

    def __init__(self, config, **kwargs):
        raise RuntimeError("grammar compiler not installed")

    @classmethod
    def validate(cls, spec):
        pass


# --- raising or hanging at run time, in the frontend --------------------------------------


#: The steps the working logger was given, read by tests running the frontend in-process.
RECORDED: list[int] = []


class CountingStatLogger(StatLogger):
    """Works: counts the steps it is given."""

    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        RECORDED.append(engine_index)


class RecordRaisingStatLogger(StatLogger):
    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        raise RuntimeError("metrics sink rejected the sample")

    def log(self):
        raise RuntimeError("metrics sink rejected the line")


class RecordHangingStatLogger(StatLogger):
    def record(self, scheduler_stats, iteration_stats, engine_index=0):
        threading.Event().wait()  # a metrics push that never returns

    def log(self):
        threading.Event().wait()


#: Written by :class:`HangingToolParser` as it starts to hang.
PARSE_ENTERED = "hanging_tool_parser: parse entered"


class RaisingToolParser(ToolParser):
    def parse(self, text, final):
        raise RuntimeError("tool grammar table missing")


class HangingToolParser(ToolParser):
    def parse(self, text, final):
        # Said on stderr (the server's log), so a test knows a request is held here.
        print(f"{PARSE_ENTERED} {text!r}", file=sys.stderr, flush=True)
        threading.Event().wait()


class RaisingReasoningParser(ThinkTagReasoningParser):
    def parse(self, text, final):
        raise RuntimeError("think markers table missing")


class HangingReasoningParser(ThinkTagReasoningParser):
    def parse(self, text, final):
        threading.Event().wait()


class FinalRaisingReasoningParser(ThinkTagReasoningParser):
    """Splits every streamed delta, but fails the whole reply's split."""

    def extract_reasoning(self, text):
        raise RuntimeError("think markers unbalanced")


def raising_rpc(worker):
    raise RuntimeError("profiler not attached")


# --- registrations the engine could never use: dropped when added -------------------------


class NotAnAttention:
    """A plain class registered as an attention backend."""


class NoConfigPolicy(SchedulingPolicy):
    """Cannot be built as ``cls(config)``."""

    def __init__(self):
        pass

    def sort_key(self, request):
        return 0


class HalfConnector:
    """Builds a scheduler half only."""

    def scheduler_side(self, config):
        return None


def no_worker_rpc():
    """Cannot take the worker."""


def no_tokenizer_tool_parser():
    """Cannot be called as ``factory(tokenizer)``."""


NOT_CALLABLE = 42


def ping(worker):
    return "pong"


def hang(worker):
    threading.Event().wait()


@enginecore.hookimpl
def register_linear_methods(registry):
    registry.add("not_a_linear", NotALinear)
    registry.add("raising_linear", RaisingLinear)
    registry.add("wrong_shape_linear", WrongShapeLinear)
    registry.add("hanging_prepare_linear", HangingPrepareLinear)


@enginecore.hookimpl
def register_attention_backends(registry):
    registry.add("raising_attention", RaisingAttention)
    registry.add("wrong_shape_attention", WrongShapeAttention)
    registry.add("hanging_attention", HangingAttention)
    registry.add("not_an_attention", NotAnAttention)


@enginecore.hookimpl
def register_kv_connectors(registry):
    registry.add("raising_connector", RaisingConnectorFactory)
    registry.add("hanging_load_connector", HangingLoadConnector)
    registry.add("half_connector", HalfConnector)
    registry.add("raising_load_connector", RaisingLoadConnector)
    registry.add("worker_raising_connector", WorkerRaisingConnector)


@enginecore.hookimpl
def register_scheduling_policies(registry):
    registry.add("unorderable", UnorderablePolicy)
    registry.add("hanging_sort", HangingPolicy)
    registry.add("no_config_policy", NoConfigPolicy)
    registry.add("raising_policy", RaisingPolicy)


@enginecore.hookimpl
def register_worker_rpcs(registry):
    registry.add("ping", ping)
    registry.add("hang", hang)
    registry.add("raising_rpc", raising_rpc)
    registry.add("no_worker_rpc", no_worker_rpc)


@enginecore.hookimpl
def register_schedulers(registry):
    registry.add("raising_scheduler", RaisingScheduler)
    registry.add("hanging_scheduler", HangingScheduler)
    registry.add("missing_scheduler", "enginecore_broken_parts.plugin:NoSuchScheduler")


@enginecore.hookimpl
def register_executors(registry):
    registry.add("raising_executor", RaisingExecutor)
    registry.add("hanging_executor", HangingExecutor)


@enginecore.hookimpl
def register_model_runners(registry):
    registry.add("raising_runner", RaisingRunner)
    registry.add("hanging_runner", HangingRunner)


@enginecore.hookimpl
def register_models(registry):
    registry.add("RaisingForCausalLM", raising_model)
    registry.add("HangingForCausalLM", HangingForCausalLM)
    registry.add("NotCallableForCausalLM", NOT_CALLABLE)


@enginecore.hookimpl
def register_stat_loggers(registry):
    registry.add("raising_logger", RaisingStatLogger)
    registry.add("counting_logger", CountingStatLogger)
    registry.add("record_raising_logger", RecordRaisingStatLogger)
    registry.add("record_hanging_logger", RecordHangingStatLogger)


@enginecore.hookimpl
def register_spec_decode_proposers(registry):
    registry.add("raising_proposer", RaisingProposer)
    registry.add("hanging_proposer", HangingProposer)
    registry.add("long_drafts_proposer", LongDraftsProposer)
    registry.add("float_drafts_proposer", FloatDraftsProposer)
    registry.add("not_callable_proposer", NOT_CALLABLE)


@enginecore.hookimpl
def register_structured_output_backends(registry):
    registry.add("raising_grammar", RaisingGrammarBackend)
    registry.add("no_token_grammar", NoTokenGrammarBackend)
    registry.add("not_callable_grammar", NOT_CALLABLE)


@enginecore.hookimpl
def register_tool_parsers(registry):
    registry.add("raising_tool_parser", RaisingToolParser)
    registry.add("hanging_tool_parser", HangingToolParser)
    registry.add("no_tokenizer_tool_parser", no_tokenizer_tool_parser)


@enginecore.hookimpl
def register_reasoning_parsers(registry):
    registry.add("raising_reasoning_parser", RaisingReasoningParser)
    registry.add("hanging_reasoning_parser", HangingReasoningParser)
    registry.add("final_raising_reasoning_parser", FinalRaisingReasoningParser)
    registry.add("not_callable_reasoning_parser", NOT_CALLABLE)

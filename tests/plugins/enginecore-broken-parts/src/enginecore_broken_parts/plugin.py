"""Each component here fails in one way; ``ping`` works. Nothing is selected unless a
config names it, so an engine with the default config must not notice any of them."""

import threading

import enginecore
from enginecore.interfaces import (
    KVConnectorFactory,
    KVConnectorScheduler,
    KVConnectorWorker,
    SchedulingPolicy,
)
from enginecore.layers import UnquantizedLinearMethod
from enginecore.layers.torch_attention import TorchAttentionBackend

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


class UnorderablePolicy(SchedulingPolicy):
    def sort_key(self, request):
        return object()  # two of them cannot be compared


class HangingPolicy(SchedulingPolicy):
    def sort_key(self, request):
        threading.Event().wait()  # holds the engine loop for good


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


@enginecore.hookimpl
def register_kv_connectors(registry):
    registry.add("raising_connector", RaisingConnectorFactory)
    registry.add("hanging_load_connector", HangingLoadConnector)


@enginecore.hookimpl
def register_scheduling_policies(registry):
    registry.add("unorderable", UnorderablePolicy)
    registry.add("hanging_sort", HangingPolicy)


@enginecore.hookimpl
def register_worker_rpcs(registry):
    registry.add("ping", ping)
    registry.add("hang", hang)

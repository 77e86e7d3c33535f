"""Hook implementations only: the executor is registered as a lazy reference."""

import enginecore

plugin_api_versions = ">=1.0,<2"
plugin_settings = "enginecore_timing_executor.executor:TimingSettings"


@enginecore.hookimpl
def register_executors(registry):
    registry.add(
        "timed",
        "enginecore_timing_executor.executor:TimingExecutor",
        summary="wraps another executor and times each collective_rpc",
    )

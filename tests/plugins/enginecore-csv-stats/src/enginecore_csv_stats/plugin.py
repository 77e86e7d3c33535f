"""Hook implementations only: the logger is registered as a lazy reference."""

import enginecore

plugin_api_versions = ">=1.0,<2"
plugin_settings = "enginecore_csv_stats.logger:CsvSettings"


@enginecore.hookimpl
def register_stat_loggers(registry):
    registry.add(
        "csv",
        "enginecore_csv_stats.logger:CsvStatLogger",
        summary="one CSV row per finished request",
    )

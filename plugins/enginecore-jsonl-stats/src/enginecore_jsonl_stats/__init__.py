"""A JSON-lines stat logger for enginecore (an example plugin to copy)."""

from enginecore_jsonl_stats.logger import DEFAULT_PATH, PATH_ENV_VAR, JsonlSettings, JsonlStatLogger

__version__ = "0.1.0"
__all__ = ["DEFAULT_PATH", "PATH_ENV_VAR", "JsonlSettings", "JsonlStatLogger", "__version__"]

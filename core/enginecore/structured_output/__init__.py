"""Constrained decoding: grammars compiled in the engine core, applied as a bitmask.

The grammar backend is a plugin (``register_structured_output_backends``); this package
holds the engine-side machinery every backend shares: the compile thread pool and cache,
the per-request grammars, the batch bitmask, and the frontend's early validation.
"""

from enginecore.structured_output.keys import grammar_key
from enginecore.structured_output.manager import StructuredOutputManager
from enginecore.structured_output.validation import StructuredOutputValidator

__all__ = ["StructuredOutputManager", "StructuredOutputValidator", "grammar_key"]

"""A loop-continuing speculative-decoding proposer for enginecore (an example to copy)."""

from enginecore_cycle_proposer.proposer import CycleProposer

__version__ = "0.1.0"
__all__ = ["CycleProposer", "__version__"]

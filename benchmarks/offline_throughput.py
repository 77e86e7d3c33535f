"""Offline throughput against transformers' generate, in one run (see enginecore.bench.throughput).

    python benchmarks/offline_throughput.py MODEL_DIR --workload fixed --num-prompts 256
    python benchmarks/offline_throughput.py MODEL_DIR --workload varied --num-prompts 64

Same as ``enginecore bench throughput``.
"""

import argparse
import sys

from enginecore.bench.throughput import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))

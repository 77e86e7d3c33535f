"""Serving benchmark: the same as ``enginecore bench serve`` (see enginecore.bench.serving).

    enginecore serve MODEL --port 8000 &
    python benchmarks/serving.py --num-prompts 200 --input-len 128 --output-len 128 \\
        --request-rate 1,2,4,8,16,inf --result-file serving.json --plot serving.png
"""

import sys

from enginecore.bench.serving import main

if __name__ == "__main__":
    sys.exit(main())

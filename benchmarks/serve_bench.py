"""``python -m benchmarks.serve_bench``: ``encdec bench serve`` from a checkout."""
from __future__ import annotations

from encdec.bench.serve_bench import main

if __name__ == "__main__":
    main()

"""``python -m benchmarks.swap_bench``: ``encdec bench swap`` from a checkout."""
from __future__ import annotations

from encdec.bench.swap_bench import main

if __name__ == "__main__":
    main()

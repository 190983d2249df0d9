"""``python -m benchmarks.realtime_bench``: ``encdec bench realtime`` from a checkout."""
from __future__ import annotations

from encdec.bench.realtime_bench import main

if __name__ == "__main__":
    main()

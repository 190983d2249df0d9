"""``python -m benchmarks.ray_bench``: ``encdec bench ray`` from a checkout."""
from __future__ import annotations

from encdec.bench.ray_bench import main

if __name__ == "__main__":
    main()

"""``python -m benchmarks.encoder_cache_bench``: ``encdec bench encoder_cache`` from a checkout."""
from __future__ import annotations

from encdec.bench.encoder_cache_bench import main

if __name__ == "__main__":
    main()

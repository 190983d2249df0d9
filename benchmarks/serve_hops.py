"""``python -m benchmarks.serve_hops``: where the Ray Serve path of ``encdec serve`` spends its time."""
from __future__ import annotations

from encdec.bench.serve_hops import main

if __name__ == "__main__":
    main()

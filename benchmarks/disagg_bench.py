"""``python -m benchmarks.disagg_bench``: bytes and transfer time per request of disaggregated Whisper serving."""
from __future__ import annotations

from encdec.bench.disagg_bench import main

if __name__ == "__main__":
    main()

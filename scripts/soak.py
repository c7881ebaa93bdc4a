#!/usr/bin/env python
"""Latency soak: N simulated callers over real sockets (realtime/soak/run.py; also `duplex soak`).

    python scripts/soak.py --sessions 8 --duration 60

Starts `duplex serve` on the tiny model unless --url is given; the last line is the report's path
(JSON with p50/p95/p99 per transport, frames_unaccounted, sessions_crashed; a PNG plot beside it).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from realtime.soak.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

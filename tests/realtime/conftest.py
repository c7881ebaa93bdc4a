"""Realtime test fixtures: speech from espeak-ng (skipped with a reason when it is missing)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

# tests/ has no packages and pytest may run with --import-mode=importlib: make rt_helpers importable.
sys.path.insert(0, str(Path(__file__).parent))
from rt_helpers import espeak  # noqa: E402


@pytest.fixture(scope="session")
def speech():
    """speech(text, rate_hz) -> int16 mono speech from espeak-ng."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng); needed for real speech input")
    return espeak

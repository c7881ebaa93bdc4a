"""Shared fixtures: the tiny model (built once per cache) and real vLLM engines on a loop thread."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    from engine.tiny import ensure_tiny

    return ensure_tiny(seed=0)


class LoopThread:
    """An asyncio loop on its own thread, so one vLLM AsyncLLM can serve many sync tests."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="engine-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 600) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        async def cancel_rest() -> None:  # e.g. vLLM's output handlers: no "Task was destroyed" at exit
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        try:
            self.run(cancel_rest(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def start_engine(loop_thread: LoopThread, **cfg_kwargs):
    from engine.async_engine import AsyncOpusEngine, EngineConfig

    return loop_thread.run(AsyncOpusEngine.start(EngineConfig(**cfg_kwargs)))


@pytest.fixture(scope="session")
def engine_factory(loop_thread: LoopThread):
    """Start an extra AsyncOpusEngine on the shared loop: `engine_factory(model=..., ...)`."""
    return lambda **cfg_kwargs: start_engine(loop_thread, **cfg_kwargs)


@pytest.fixture(scope="session")
def vllm_engine(loop_thread: LoopThread, tiny_model: Path):
    engine = start_engine(loop_thread, model=str(tiny_model), max_num_seqs=32)
    yield engine
    engine.shutdown()


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

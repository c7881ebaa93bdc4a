"""No import cycle among our modules (function-level imports count): each layer can be read,
tested and replaced without the ones above it (docs/architecture.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("import_graph", Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)


def test_the_detector_finds_a_cycle_and_only_the_cycle() -> None:
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_graph.cycles(g) == [["a", "b", "c"]]
    assert import_graph.cycles({"a": {"b"}, "b": set()}) == []


def test_the_function_level_imports_of_a_module_count() -> None:
    g = import_graph.graph(["realtime"])
    assert "realtime.session" in g["realtime.runner"]  # a top-level import
    assert "realtime.transports.websocket" in g["realtime.transports.webrtc"]


def test_engine_and_realtime_have_no_import_cycle(capsys) -> None:
    code = import_graph.main([])
    assert code == 0, capsys.readouterr().err

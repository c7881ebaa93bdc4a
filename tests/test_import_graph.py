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


def _reach(g: dict[str, set[str]], module: str) -> set[str]:
    seen: set[str] = set()
    todo = [module]
    while todo:
        for dep in g[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_engine_never_imports_the_gateway() -> None:
    """engine/ sits below realtime/: the `duplex` command line that names both lives in realtime/cli/main.py."""
    g = import_graph.graph(["engine", "realtime"])
    upward = {m: sorted(d for d in deps if d.startswith("realtime")) for m, deps in g.items() if m.startswith("engine")}
    assert {m: d for m, d in upward.items() if d} == {}
    assert {"engine.cli", "realtime.cli.serve"} <= g["realtime.cli.main"]


def test_the_model_layers_take_their_units_from_the_bottom_not_from_the_gateway_contract() -> None:
    g = import_graph.graph(["engine"])
    assert g["engine.units"] == set()
    assert "engine.units" in g["engine.vocab"] and "engine.units" in g["engine.vllm_plugin.scheduler"]
    model_layers = [m for m in g if m in ("engine.vocab", "engine.delay", "engine.modality", "engine.heads", "engine.request")
                    or m.startswith(("engine.codec", "engine.vllm_plugin", "engine.convert"))]
    assert len(model_layers) > 20
    assert [m for m in model_layers if "engine.service_api" in _reach(g, m)] == []

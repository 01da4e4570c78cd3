"""Metric names: every tabloop metric is namespaced and documented in docs/METRICS.md."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import REGISTRY

import service.metrics
import trainer.metrics

DOC = (Path(__file__).resolve().parents[1] / "docs" / "METRICS.md").read_text()


def test_our_metrics_are_namespaced_and_documented() -> None:
    ours = [
        m
        for module in (service.metrics, trainer.metrics)
        for m in vars(module).values()
        if hasattr(m, "_name") and hasattr(m, "_type")
    ]
    assert len(ours) >= 17
    for metric in ours:
        name = metric._name + ("_total" if metric._type == "counter" else "")
        assert name.startswith("tabloop_"), name
        assert f"`{name}`" in DOC, f"{name} is not in docs/METRICS.md"
    names = {m.name for m in REGISTRY.collect()}
    assert "tabloop_ingest_events" in names  # a counter is collected without its _total

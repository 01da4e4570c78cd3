"""What a run writes under --out: report.json (its keys: simulator.report's docstring),
records.jsonl (one request a line), settled_lines.json (the [path, line] of every line a
code_settled was sent for) and learning_curve.png; then the summary it prints."""

from __future__ import annotations

import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from simulator import phases
from simulator import report as rpt
from simulator.display import print_summary
from simulator.plot import plot

if TYPE_CHECKING:
    from simulator.config import SimConfig, SimulationState


SECRET_FLAGS = ("--key", "--admin-key")


def redacted(argv: list[str]) -> list[str]:
    """The command line as the report keeps it: API keys replaced, so a report can be shared."""
    out = list(argv)
    for i, arg in enumerate(out):
        flag, eq, _ = arg.partition("=")
        if flag in SECRET_FLAGS and eq:
            out[i] = f"{flag}=<redacted>"
        elif arg in SECRET_FLAGS and i + 1 < len(out):
            out[i + 1] = "<redacted>"
    return out


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
    }


def build_report(
    cfg: SimConfig,
    sim: SimulationState,
    spec_source: str,
    deployments: list[dict[str, Any]] | None,
    training: dict[str, Any] | None,
    baseline: dict[str, Any] | None,
    trainer: phases.TrainerPhases | None = None,
) -> dict[str, Any]:
    """report.json (its keys: simulator.report's docstring)."""
    baseline_s = cfg.baseline_s
    learning_s = phases.learning_span(baseline_s, sim.duration_s)
    summary = rpt.fifths(phases.learning_records(sim.records, baseline_s), learning_s)
    events = sim.sender.summary()
    gated = None if deployments is None else rpt.gated_deploys(deployments)
    deploy_counts = (
        None
        if deployments is None
        else {
            a: sum(d["action"] == a for d in deployments) for a in ("deploy", "promote", "rollback")
        }
    )
    versus = (
        phases.targets_summary(sim.records, baseline_s, sim.duration_s)
        if baseline_s > 0
        else summary
    )
    honest, by_kind = rpt.split_people(sim.records)
    return {
        "config": {
            "api": cfg.api,
            "users": cfg.users,
            "minutes": cfg.minutes,
            "baseline_minutes": cfg.baseline_minutes,
            "seed": cfg.seed,
            "duration_s": sim.duration_s,
            "settled_share": cfg.settled_share,
            "corpus": None if cfg.corpus is None else str(cfg.corpus.resolve()),
            "bucket_s": cfg.bucket_width_s,
            "max_new_tokens": cfg.max_new_tokens,
            "population": cfg.population.to_dict(),
            "people": cfg.people,  # telemetry or proxy (simulator.telemetry)
            "telemetry": cfg.telemetry.to_dict() if cfg.people == "telemetry" else None,
            "reward_spec": sim.spec,
            "adversaries": cfg.adversaries,
            "adversary_kinds": list(cfg.adversary_kinds),
            "mode": cfg.mode,
            "reward_spec_source": spec_source,
            "started_at": sim.started_at.isoformat().replace("+00:00", "Z"),
            "machine": machine(),
            "argv": redacted(sys.argv[1:]),
        },
        "totals": {
            **rpt.metrics(sim.records),
            **asdict(sim.counters),
            "completions": len(sim.records),
            "events": events,
            "http": asdict(sim.client.stats),
        },
        "phases": {
            "baseline_s": baseline_s,
            "learning_s": learning_s,
            "trainer": None if trainer is None else asdict(trainer),
        },
        "buckets": rpt.bucketize(sim.records, cfg.bucket_width_s, sim.duration_s),
        "fifths": summary,
        # the first and last third of the run (writing mode's comparison; useful characters
        # first)
        "thirds": rpt.thirds(sim.records, sim.duration_s),
        "phase_comparison": {
            **phases.learning_comparison(sim.records, baseline_s, sim.duration_s),
            "gated_deploys": gated,
            "gated_deploys_in_baseline_phase": phases.baseline_phase_deploys(
                deployments, baseline_s
            ),
            "deploy_counts": deploy_counts,
            "errors": sim.counters.errors,
            "events_refused": events["rejected"],
            "events_lost": events["dropped"] + events["pending"],
        },
        "by_version": rpt.by_version(sim.records),
        "by_length": rpt.by_length(sim.records),
        "deployments": deployments,
        "deploy_counts": deploy_counts,
        "gated_deploys": gated,
        "training": training,
        "baseline": baseline,
        "comparison": rpt.compare(summary, baseline),
        "targets": rpt.targets(versus, deployments),
        "settled": {
            "share": cfg.settled_share,
            "people": sim.counters.people,
            "opted_in": sim.counters.settled_people,
            "events": sim.counters.settled,
            "lines": len(sim.settled_lines),
        },
        "honest": honest_section(honest, baseline_s, sim.duration_s, deployments),
        "adversaries": {
            "count": sim.counters.adversaries,
            "kinds": [k for k in sim.kinds if k is not None],
            "by_kind": {k: rpt.adversary_metrics(rs) for k, rs in by_kind.items()},
            "events": sim.adversary_sender.summary(),
        },
    }


def honest_section(
    records: list[rpt.RequestRecord],
    baseline_s: float,
    duration_s: float,
    deployments: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    """The honest people's figures alone (report.json `honest`)."""
    learning_s = phases.learning_span(baseline_s, duration_s)
    versus = (
        phases.targets_summary(records, baseline_s, duration_s)
        if baseline_s > 0
        else rpt.fifths(phases.learning_records(records, baseline_s), learning_s)
    )
    return {
        "people": len({r.user_id for r in records}),
        "totals": rpt.metrics(records),
        "comparison": phases.learning_comparison(records, baseline_s, duration_s)["all"],
        "targets": rpt.targets(versus, deployments),
    }


def write_outputs(
    cfg: SimConfig, sim: SimulationState, report: dict[str, Any], console: Console
) -> None:
    """The run's files under cfg.out, then the printed summary."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    with (cfg.out / "records.jsonl").open("w") as f:
        for r in sim.records:
            f.write(json.dumps(asdict(r)) + "\n")
    (cfg.out / "settled_lines.json").write_text(json.dumps(sorted(sim.settled_lines)))
    plot(report, cfg.out / "learning_curve.png")
    print_summary(console, report, cfg.out)


def read_records(out: Path) -> list[rpt.RequestRecord]:
    """The requests a run wrote to records.jsonl; fields a later simulator added are skipped."""
    fields = set(rpt.RequestRecord.__dataclass_fields__)
    with (out / "records.jsonl").open() as f:
        rows = [json.loads(line) for line in f]
    return [rpt.RequestRecord(**{k: v for k, v in r.items() if k in fields}) for r in rows]


def read_settled_lines(out: Path) -> set[tuple[str, int]]:
    """The (path, line) keys a run wrote to settled_lines.json (empty when it has none)."""
    path = out / "settled_lines.json"
    if not path.is_file():
        return set()
    return {(str(p), int(n)) for p, n in json.loads(path.read_text())}

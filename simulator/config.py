"""The simulation's settings (`SimConfig`), its counters, and what the live display and the
report read of a running simulation (`SimulationState`, which simulator.run.Simulation is)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from simulator import report as rpt
from simulator.client import Client, EventSender
from simulator.phases import Phase
from simulator.population import AdversaryKind, PopulationConfig
from simulator.telemetry import People, TelemetryConfig


@dataclass
class SimConfig:
    api: str  # the service's base URL
    key: str  # an API key with ingest (and, for the spec and deployments, admin) scope
    users: int = 16  # seats: people active at once
    minutes: float = 10.0  # the learning phase: how long people ask with the trainer running
    baseline_minutes: float = 0.0  # before it, with the trainer paused (needs the admin scope)
    settled_share: float = 0.0  # share of people who send code_settled
    corpus: Path | None = None  # the *.py files people edit; None: the stdlib's held-out split
    admin_key: str | None = None  # for the admin API when `key` lacks the admin scope
    seed: int = 0  # people, cursors and decisions are all drawn from it
    bucket_s: float | None = None  # report bucket width; default: the run split in ~30
    out: Path = Path("simulation")  # report.json and learning_curve.png go here
    population: PopulationConfig = field(default_factory=PopulationConfig)
    people: People = "telemetry"  # telemetry: take suggestions as real people do; proxy: control
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)  # telemetry people only
    max_new_tokens: int = 32
    baseline_cursors: int = 2000  # 0: skip the offline baseline
    baseline_checkpoint: Path | None = None  # default: the shipped base policy
    baseline_json: Path | None = None  # a baseline already computed (python -m simulator.baseline)
    live: bool | None = None  # rich live display; default: when stdout is a terminal
    flush_interval_s: float = 0.25  # events are sent at least this often
    event_batch_size: int = 200
    poll_s: float = 5.0  # how often the display reads the deployment timeline
    adversaries: int = 0  # the last N seats hold adversaries (simulator.population)
    adversary_kinds: tuple[AdversaryKind, ...] = ("accept_all", "reject_all")  # taken in turn
    mode: str = "retype"  # retype: cursors anywhere in the files; write: top to bottom

    @property
    def baseline_s(self) -> float:
        return self.baseline_minutes * 60.0

    @property
    def duration_s(self) -> float:
        """The whole run: baseline and learning phases."""
        return (self.baseline_minutes + self.minutes) * 60.0

    @property
    def bucket_width_s(self) -> float:
        return self.bucket_s or max(5.0, round(self.duration_s / 30 / 5) * 5)


def utc_z(at: datetime | None = None) -> str:
    return (at or datetime.now(UTC)).isoformat().replace("+00:00", "Z")


@dataclass
class Counters:
    people: int = 0  # people who took a seat (initial ones and replacements)
    switches: int = 0
    churns: int = 0
    away: int = 0  # seats whose person is on another model right now
    errors: int = 0  # completion requests that got no answer after retries
    retention_reports: int = 0
    settled: int = 0  # code_settled events sent
    settled_people: int = 0  # people who opted in to code_settled
    adversaries: int = 0  # seats held by adversaries (never counted in `people`)


class SimulationState(Protocol):
    """What the live display (simulator.display) and the report (simulator.output) read of a
    running simulation."""

    cfg: SimConfig
    spec: dict[str, Any]
    client: Client
    sender: EventSender
    adversary_sender: EventSender
    kinds: list[AdversaryKind | None]
    records: list[rpt.RequestRecord]
    counters: Counters
    settled_lines: set[tuple[str, int]]
    duration_s: float
    started_at: datetime

    def now(self) -> float: ...

    @property
    def phase(self) -> Phase: ...


def default_checkpoint() -> Path:
    import tabloop.core.policy

    return Path(tabloop.core.policy.__file__).resolve().parent / "base"

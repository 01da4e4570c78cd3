"""The baseline phase, and what the learning phase is compared with.

`tabloop simulate --baseline-minutes M`: before the people start, the trainer is paused
(`POST /admin/training/pause`, which needs a key with the admin scope), so the policy the run
found live serves them for M minutes: the baseline phase. Then the trainer is resumed
(`POST /admin/training/resume`) and the learning phase runs for `--minutes`. A trainer that was
already paused stays paused (the run is then a control: no learning in either phase), and one
the simulator paused is resumed whatever ends the run (its end, Ctrl-C, an error). Every request
is tagged with its phase by the time it was sent (`phase_at`).

The comparison (`learning_comparison`): the learning phase's last fifth against a reference —
the baseline phase, or without one the run's first fifth (already served in part by candidates
the trainer deployed, so it understates what was learned) — twice: on all requests, and on
fresh lines only, requests on a line whose text was never sent before in any form: no request's
prefix or suffix and no settled report held it (simulator.population.SentLines), so neither a
policy nor its workspace memory can simply recall it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from rich.console import Console

from simulator.client import ApiError, Client
from simulator.report import (
    RequestRecord,
    change_intervals,
    metrics,
    relative_change,
    split_by_time,
)

log = logging.getLogger("tabloop.simulate")

Phase = Literal["baseline", "learning"]
COMPARED = (
    "shown_per_request",
    "accept_rate_of_shown",
    "retained_chars_per_100",
    "reward_per_request",
)
COUNTS = ("requests", "shown", "accepted")
ADMIN_NEEDED = (
    "--baseline-minutes pauses and resumes the trainer, which needs a key with the "
    "admin scope: pass one with --admin-key (the people keep using --key), or make "
    "--key with `tabloop keys create --scope admin,ingest --name sim`"
)


def phase_at(t: float, baseline_s: float) -> Phase:
    """The phase of a request sent `t` seconds into the run."""
    return "baseline" if t < baseline_s else "learning"


def learning_span(baseline_s: float, duration_s: float) -> float:
    """Seconds of learning phase in a run of `duration_s` (at least 1: a run interrupted in its
    baseline phase has an empty learning phase, not a zero-width one)."""
    return max(1.0, duration_s - baseline_s)


def learning_records(records: Sequence[RequestRecord], baseline_s: float) -> list[RequestRecord]:
    """The learning phase's requests, their `t` counted from its start."""
    return [replace(r, t=r.t - baseline_s) for r in records if r.phase == "learning"]


def windows(
    records: Sequence[RequestRecord], baseline_s: float, duration_s: float
) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """(reference, last): the baseline phase's requests (the learning phase's first fifth when
    baseline_s is 0) and the learning phase's last fifth."""
    span = learning_span(baseline_s, duration_s)
    parts = [p for _, _, p in split_by_time(learning_records(records, baseline_s), span / 5, span)]
    if baseline_s > 0:
        return [r for r in records if r.phase == "baseline"], parts[-1]
    return parts[0], parts[-1]


def compare_sides(
    reference: Sequence[RequestRecord], last: Sequence[RequestRecord]
) -> dict[str, Any]:
    """The COMPARED rates of both windows (with their COUNTS), the relative change (None unless
    the reference is > 0), the difference, and the 95% bootstrap interval of the change
    (report.change_intervals: people resampled) where one exists."""
    a, b = metrics(reference), metrics(last)
    return {
        "reference": {k: a[k] for k in COUNTS + COMPARED},
        "last_fifth": {k: b[k] for k in COUNTS + COMPARED},
        "change": {k: relative_change(a[k], b[k]) for k in COMPARED},
        "difference": {k: None if a[k] is None or b[k] is None else b[k] - a[k] for k in COMPARED},
        "interval": change_intervals(reference, last),
    }


def learning_comparison(
    records: Sequence[RequestRecord], baseline_s: float, duration_s: float
) -> dict[str, Any]:
    """The learning phase's last fifth against the reference, on all lines and on fresh ones."""
    reference, last = windows(records, baseline_s, duration_s)
    span = learning_span(baseline_s, duration_s)
    has_baseline = baseline_s > 0
    return {
        "reference": "baseline_phase" if has_baseline else "first_fifth",
        "note": (
            f"the learning phase's last fifth against the baseline phase ({baseline_s:g} s, "
            "trainer paused)"
            if has_baseline
            else "no baseline phase (--baseline-minutes 0): the reference is the run's first "
            "fifth, already served in part by policies the trainer deployed"
        ),
        "reference_window_s": [0.0, baseline_s if has_baseline else span / 5],
        "last_window_s": [baseline_s + span * 4 / 5, baseline_s + span],
        "all": compare_sides(reference, last),
        "fresh": compare_sides([r for r in reference if r.fresh], [r for r in last if r.fresh]),
    }


def targets_summary(
    records: Sequence[RequestRecord], baseline_s: float, duration_s: float
) -> dict[str, Any]:
    """The reference and the last fifth in the shape `report.targets` reads (first, last,
    change, interval), so the targets compare with the baseline phase when there is one."""
    reference, last = windows(records, baseline_s, duration_s)
    a, b = metrics(reference), metrics(last)
    return {
        "first": a,
        "last": b,
        "change": {k: relative_change(a[k], b[k]) for k in COMPARED},
        "interval": change_intervals(reference, last),
    }


def baseline_phase_deploys(
    deployments: Sequence[dict[str, Any]] | None, baseline_s: float
) -> int | None:
    """Gated (canary) deploys made during the baseline phase: 0 when the pause held."""
    if deployments is None:
        return None
    return sum(
        d["action"] == "deploy" and d.get("canary_version") is not None and d["t"] < baseline_s
        for d in deployments
    )


# --- pausing and resuming the trainer ----------------------------------------------------------


@dataclass
class TrainerPhases:
    """What the simulator did to the trainer, for the report."""

    paused_before: bool | None = None  # the trainer was paused when the run started (None: unread)
    paused_by_simulator: bool = False
    paused_at_s: float | None = None  # seconds into the run
    resumed_at_s: float | None = None  # None: never resumed by the simulator
    note: str = ""


class TrainerControl:
    """Pauses the trainer for the baseline phase and resumes it after, through the admin API."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.state = TrainerPhases()

    async def read_paused(self) -> bool:
        """Whether the trainer is paused now; ApiError(403, ADMIN_NEEDED) for a key without the
        admin scope, so a run fails before the people start."""
        status, body = await self.client.get("/admin/training")
        if status == 403:
            raise ApiError(403, ADMIN_NEEDED)
        if status != 200 or not isinstance(body, dict):
            raise ApiError(status, f"GET /admin/training answered {status}: {body}")
        return bool(body.get("paused"))

    async def _set(self, action: str) -> None:
        status, body = await self.client.post(f"/admin/training/{action}")
        if status == 403:
            raise ApiError(403, ADMIN_NEEDED)
        if status != 200:
            raise ApiError(status, f"POST /admin/training/{action} answered {status}: {body}")

    async def pause(self, t: float) -> None:
        """Pause for the baseline phase, unless the trainer is already paused (then it stays so:
        the simulator never resumes what it did not pause)."""
        self.state.paused_before = await self.read_paused()
        if self.state.paused_before:
            self.state.note = (
                "the trainer was already paused before the run: it stays paused, "
                "so neither phase learns (a control)"
            )
            return
        await self._set("pause")
        self.state.paused_by_simulator, self.state.paused_at_s = True, round(t, 3)
        self.state.note = "paused by the simulator for the baseline phase"

    async def resume(self, t: float) -> None:
        """Resume the trainer if the simulator paused it and has not resumed it yet."""
        if not self.state.paused_by_simulator or self.state.resumed_at_s is not None:
            return
        await self._set("resume")
        self.state.resumed_at_s = round(t, 3)
        self.state.note = "paused by the simulator for the baseline phase, then resumed"


async def start(
    baseline_minutes: float, minutes: float, admin: Client | None, console: Console
) -> TrainerControl | None:
    """Before the people start: pause the trainer for a baseline phase (which needs the admin
    scope: ApiError(403, ADMIN_NEEDED) without it), or only read whether it is paused (when the
    key may). None when the key may not."""
    if admin is None:
        if baseline_minutes > 0:
            raise ApiError(403, ADMIN_NEEDED)
        return None
    control = TrainerControl(admin)
    if baseline_minutes > 0:
        await control.pause(0.0)
        if control.state.paused_by_simulator:
            console.print(
                f"baseline phase: the trainer is paused for {baseline_minutes:g} min, "
                f"then resumed for {minutes:g} min of learning",
                highlight=False,
            )
        else:
            console.print(f"[yellow]{control.state.note}[/]", highlight=False)
    else:
        control.state.paused_before = await control.read_paused()
        if control.state.paused_before:
            control.state.note = "the trainer was paused before the run (and stays so)"
            console.print(f"[yellow]{control.state.note}[/]", highlight=False)
    return control


async def resume(control: TrainerControl | None, at_s: float, console: Console) -> None:
    """Resume a trainer the simulator paused and has not resumed yet. A failure is reported (the
    operator must resume it by hand), not raised over whatever ended the run."""
    if control is None:
        return
    pending = control.state.paused_by_simulator and control.state.resumed_at_s is None
    try:
        await control.resume(at_s)
    except ApiError as e:
        log.error(
            "could not resume the trainer (%s): resume it with POST /admin/training/resume", e
        )
        console.print(
            f"[red]the trainer is still paused ({e}): resume it with POST "
            "/admin/training/resume[/]",
            highlight=False,
        )
        return
    if pending:
        console.print(
            "the trainer was resumed (the run ended in its baseline phase)", highlight=False
        )

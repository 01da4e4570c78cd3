"""The learning curve as it happens (a rich live table on a terminal, else a line per bucket),
and the summary printed at the end of a run."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from simulator import report as rpt

if TYPE_CHECKING:
    from simulator.client import Client
    from simulator.config import SimConfig, SimulationState

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float | None], low: float = 0.0, high: float = 1.0) -> str:
    out = []
    for v in values:
        if v is None:
            out.append(" ")
            continue
        x = 0.0 if high <= low else (min(high, max(low, v)) - low) / (high - low)
        out.append(SPARK[min(len(SPARK) - 1, int(x * len(SPARK)))])
    return "".join(out)


def fmt(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


class Display:
    """The learning curve as it happens: a rich live table on a terminal, else a line a bucket."""

    def __init__(
        self, cfg: SimConfig, admin: bool, console: Console, admin_client: Client | None = None
    ) -> None:
        self.cfg, self.admin, self.console = cfg, admin, console
        self.admin_client = admin_client  # for the admin API; default: the simulation's client
        self.live = console.is_terminal if cfg.live is None else cfg.live
        self.deployments: list[dict[str, Any]] = []
        self.training: dict[str, Any] = {}
        self.status = "running"
        self.done = False
        self._printed = 0

    async def _poll(self, sim: SimulationState) -> None:
        if not self.admin:
            return
        client = self.admin_client or sim.client
        status, body = await client.get("/admin/deployments", limit=200)
        if status == 200 and isinstance(body, list):
            self.deployments = rpt.timeline(body, sim.started_at, sim.now() + 1)
        status, body = await client.get("/admin/training")
        if status == 200 and isinstance(body, dict):
            self.training = body

    def _buckets(self, sim: SimulationState) -> list[dict[str, Any]]:
        width = self.cfg.bucket_width_s
        upto = min(self.cfg.duration_s, sim.now())
        return rpt.bucketize(sim.records, width, max(width, upto))

    def render(self, sim: SimulationState) -> Group:
        buckets = self._buckets(sim)
        table = Table(title="tabloop simulate — learning curve", expand=False)
        for col in (
            "t (s)",
            "requests",
            "kept ch/100",
            "accept/shown",
            "not taken/req",
            "shown/req",
            "def/class shown",
            "reward/req",
            "versions",
        ):
            table.add_column(col, justify="right")
        for b in buckets[-12:]:
            table.add_row(
                f"{b['t0']:.0f}",
                str(b["requests"]),
                fmt(b["kept_chars_per_100"], ".1f"),
                fmt(b["accept_rate_of_shown"]),
                fmt(b["not_taken_per_request"]),
                fmt(b["shown_per_request"]),
                fmt(b["family_shown_rate"]),
                fmt(b["reward_per_request"], ".3f"),
                " ".join(f"v{v}:{n}" for v, n in b["versions"].items()),
            )
        c, ev, cl = sim.counters, sim.sender.stats, sim.client.stats
        acts = {
            a: sum(d["action"] == a for d in self.deployments)
            for a in ("deploy", "promote", "rollback")
        }
        phase = ""
        if self.cfg.baseline_s > 0:
            phase = (
                "baseline phase (trainer paused) · "
                if sim.phase == "baseline"
                else "learning phase · "
            )
        kept = sparkline([b["kept_chars_per_100"] for b in buckets], 0, 300)
        lines = [
            f"[bold]{self.status}[/] {phase}{min(sim.now(), self.cfg.duration_s):.0f}/"
            f"{self.cfg.duration_s:.0f} s · {self.cfg.users} seats · {c.people} people · "
            f"{c.away} away · {c.switches} switches · {c.churns} churned · {c.errors} errors",
            f"kept ch/100 {kept}   "
            f"accept/shown {sparkline([b['accept_rate_of_shown'] for b in buckets])}   "
            f"not taken/req {sparkline([b['not_taken_per_request'] for b in buckets], 0, 0.5)}   "
            f"shown/req {sparkline([b['shown_per_request'] for b in buckets], 0, 0.5)}   "
            f"def/class shown {sparkline([b['family_shown_rate'] for b in buckets], 0, 0.5)}",
            f"events {ev.sent}/{ev.queued} sent · {ev.duplicates} dup · {ev.rejected} refused · "
            f"{c.settled} settled · "
            f"{cl.retries} retries ({cl.throttled}×429, {cl.unavailable}×503)",
        ]
        if self.admin:
            trainer = self.training.get("trainer") or {}
            lines.append(
                f"deploys {acts['deploy']} · promotions {acts['promote']} · rollbacks "
                f"{acts['rollback']} · trainer {trainer.get('state', '?')} · rewards "
                f"finalized {self.training.get('rewards_finalized', '?')}"
            )
        return Group(table, *[Text.from_markup(x) for x in lines])

    def _print_new_buckets(self, sim: SimulationState) -> None:
        width = self.cfg.bucket_width_s
        complete = int(min(self.cfg.duration_s, sim.now()) // width)
        if self.done:
            complete = math.ceil(self.cfg.duration_s / width - 1e-9)
        buckets = self._buckets(sim)
        for b in buckets[self._printed : complete]:
            phase = "baseline " if b["t1"] <= self.cfg.baseline_s else ""
            print(
                f"{phase}t={b['t0']:6.0f}s requests {b['requests']:4d}  kept ch/100 "
                f"{fmt(b['kept_chars_per_100'], '.1f')}  accept/shown "
                f"{fmt(b['accept_rate_of_shown'])}  not taken/req "
                f"{fmt(b['not_taken_per_request'])}  shown/req "
                f"{fmt(b['shown_per_request'])}  def/class shown "
                f"{fmt(b['family_shown_rate'])}  versions "
                + " ".join(f"v{v}:{n}" for v, n in b["versions"].items()),
                flush=True,
            )
        self._printed = max(self._printed, complete)

    async def run(self, sim: SimulationState) -> None:
        last_poll = -math.inf
        if not self.live:
            while not self.done:
                if time.monotonic() - last_poll >= self.cfg.poll_s:
                    last_poll = time.monotonic()
                    await self._poll(sim)
                self._print_new_buckets(sim)
                await asyncio.sleep(0.5)
            self._print_new_buckets(sim)
            return
        with Live(self.render(sim), console=self.console, auto_refresh=False) as live:
            while not self.done:
                if time.monotonic() - last_poll >= self.cfg.poll_s:
                    last_poll = time.monotonic()
                    await self._poll(sim)
                live.update(self.render(sim), refresh=True)
                await asyncio.sleep(1.0)
            self.status = "finished"
            live.update(self.render(sim), refresh=True)


def change_text(change: float | None, first: float | None, last: float | None, form: str) -> str:
    """A relative change as a percentage; the difference where there is no ratio (from <= 0)."""
    if change is not None:
        return f"{change:+.0%}"
    if first is not None and last is not None:
        return f"{last - first:+{form}}"
    return "-"


# what people keep first; the accept rate is secondary (a policy that shows less is accepted
# more often and gives less code). retained_chars_per_100 is kept_chars_per_100's older name,
# which every report (and simulator.phases' comparison) has.
ROWS = (
    ("retained_chars_per_100", "kept chars / 100 req", ".1f"),
    ("accept_rate_of_shown", "accept rate of shown", ".3f"),
    ("not_taken_per_request", "not taken per request", ".3f"),
    ("shown_per_request", "shown per request", ".3f"),
    ("reward_per_request", "reward per request", ".4f"),
)


THIRDS_ROWS = (
    ("useful_chars_per_100", "useful chars / 100 req", ".1f"),
    ("whole_line_rate", "whole rest of line", ".3f"),
    ("exact_of_shown", "exact of shown", ".3f"),
    ("shown_per_request", "shown per request", ".3f"),
    ("wrong_shown_per_request", "wrong shown per request", ".3f"),
    ("accept_rate_of_shown", "accept rate of shown", ".3f"),
    ("latency_ms_p50", "latency p50 ms", ".1f"),
)


def phase_table(comparison: dict[str, Any]) -> Table:
    """The learning phase's last fifth against its reference, on all lines and on fresh ones."""
    reference = "baseline phase" if comparison["reference"] == "baseline_phase" else "first fifth"
    table = Table(title=f"{reference} vs last fifth of the learning phase")
    for col in (
        "",
        reference,
        "last",
        "change",
        f"fresh: {reference}",
        "fresh: last",
        "fresh: change",
    ):
        table.add_column(col, justify="right")
    both = comparison["all"], comparison["fresh"]
    table.add_row(
        "requests",
        *[
            x
            for side in both
            for x in (str(side["reference"]["requests"]), str(side["last_fifth"]["requests"]), "")
        ],
    )
    for key, label, form in ROWS:
        cells = []
        for side in both:
            a, b = with_not_taken(side["reference"])[key], with_not_taken(side["last_fifth"])[key]
            cells += [
                fmt(a, form),
                fmt(b, form),
                change_text(change_of(side, key, a, b), a, b, form),
            ]
        table.add_row(label, *cells)
    return table


def change_of(summary: dict[str, Any], key: str, a: float | None, b: float | None) -> float | None:
    """The relative change `summary` holds for key; computed where it holds none for it (the
    figures it does not compare, as not_taken_per_request)."""
    changes = summary["change"]
    return changes[key] if key in changes else rpt.relative_change(a, b)


def with_not_taken(counts: dict[str, Any]) -> dict[str, Any]:
    """`counts` (requests, shown, accepted, ...) with not_taken_per_request, derived when a
    comparison (simulator.phases) or an older report does not carry it."""
    if "not_taken_per_request" in counts:
        return counts
    rates = rpt.loop_rates(counts["requests"], counts["shown"], counts["accepted"], 0.0)
    return {**counts, "not_taken_per_request": rates["not_taken_per_request"]}


def length_table(by_length: dict[str, Any]) -> Table:
    """report.json `by_length` as one row per policy version (and all of them), a column per
    length of the shown suggestion: kept chars / 100 req · accept rate of shown · not taken /
    req."""
    labels = [*by_length["buckets"], rpt.ALL_LENGTHS]
    table = Table(
        title="by suggestion length (characters shown), per policy version: kept chars / 100 "
        "req · accept rate of shown · not taken / req"
    )
    for col in ("version", "requests", *labels):
        table.add_column(col, justify="right")
    rows = [(f"v{v}", r) for v, r in by_length["versions"].items()]
    for name, per_length in [*rows, ("all", by_length["all_versions"])]:
        cells = [
            f"{fmt(c['kept_chars_per_100'], '.1f')} · {fmt(c['accept_rate_of_shown'])} · "
            f"{fmt(c['not_taken_per_request'], '.3f')}"
            for c in (per_length[label] for label in labels)
        ]
        table.add_row(name, str(per_length[rpt.ALL_LENGTHS]["requests"]), *cells)
    return table


def print_summary(console: Console, report: dict[str, Any], out: Path) -> None:
    f = report["fifths"]
    title = (
        "first fifth vs last fifth"
        if not report["phases"]["baseline_s"]
        else "first fifth vs last fifth of the learning phase"
    )
    table = Table(title=title)
    for col in ("", "first", "last", "change", "baseline (best threshold)"):
        table.add_column(col, justify="right")
    base = (report.get("baseline") or {}).get("best") or {}
    for key, label, form in (*ROWS, ("family_shown_rate", "def/class shown rate", ".3f")):
        first, last = with_not_taken(f["first"])[key], with_not_taken(f["last"])[key]
        table.add_row(
            label,
            fmt(first, form),
            fmt(last, form),
            change_text(change_of(f, key, first, last), first, last, form),
            fmt(base.get(key), form),
        )
    console.print(table)
    if report.get("by_length"):
        console.print(length_table(report["by_length"]))
    thirds = report.get("thirds")
    if thirds:
        table = Table(
            title="first third vs last third of the run (useful: shown text that is a "
            "prefix of the true rest of the line)"
        )
        for col in ("", "first third", "last third"):
            table.add_column(col, justify="right")
        for key, label, form in THIRDS_ROWS:
            table.add_row(label, fmt(thirds["first"][key], form), fmt(thirds["last"][key], form))
        console.print(table)
    comparison = report["phase_comparison"]
    console.print(phase_table(comparison))
    console.print(f"  {comparison['note']}", highlight=False)
    trainer = (report["phases"].get("trainer") or {}).get("note")
    if trainer:
        console.print(f"  trainer: {trainer}", highlight=False)
    settled = report["settled"]
    by_type = report["totals"]["events"].get("rejected_by_type") or {}
    refused = (
        " (" + ", ".join(f"{k} {n}" for k, n in sorted(by_type.items())) + ")" if by_type else ""
    )
    console.print(
        f"  gated deploys {fmt(comparison['gated_deploys'], 'd')} (in the baseline "
        f"phase {fmt(comparison['gated_deploys_in_baseline_phase'], 'd')}) · errors "
        f"{comparison['errors']} · events refused {comparison['events_refused']}"
        f"{refused} · lost {comparison['events_lost']} · "
        f"code_settled {settled['events']} from {settled['opted_in']}/"
        f"{settled['people']} people, {settled['lines']} lines",
        highlight=False,
    )
    console.print(
        "  targets, against the "
        + ("baseline phase" if comparison["reference"] == "baseline_phase" else "first fifth")
        + ":"
    )
    for t in report["targets"]:
        mark = {True: "[green]met[/]", False: "[red]not met[/]", None: "[yellow]n/a[/]"}[t["met"]]
        value, sure = t["value"], t.get("interval")
        if isinstance(value, float):
            value = f"{value:+.0%}"
        elif isinstance(value, list) and None not in value:
            value = " -> ".join(f"{v:.1f}" for v in value)
        sure = f"; 95% interval of the change {sure[0]:+.0%} to {sure[1]:+.0%}" if sure else ""
        console.print(f"  {mark}  {t['name']}: {value} (target {t['target']}{sure})")
    adversaries = report.get("adversaries") or {}
    if adversaries.get("count"):
        h, sent = report["honest"]["totals"], adversaries["events"]
        console.print(
            f"  honest people ({report['honest']['people']}): kept chars / 100 requests "
            f"{fmt(h['retained_chars_per_100'], '.1f')} · accept rate of shown "
            f"{fmt(h['accept_rate_of_shown'], '.3f')} · shown per request "
            f"{fmt(h['shown_per_request'], '.3f')}; adversaries {adversaries['count']} "
            f"({', '.join(adversaries['kinds'])}): {sent['sent']} events sent, "
            f"{sent['rejected']} refused",
            highlight=False,
        )
    console.print(
        f"report: {out / 'report.json'}  plot: {out / 'learning_curve.png'}  "
        f"requests: {out / 'records.jsonl'}"
    )

"""The learning curve as it happens: a rich live table on a terminal, else a line per bucket."""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from simulator import report as rpt

if TYPE_CHECKING:
    from simulator.run import SimConfig, Simulation

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

    def __init__(self, cfg: SimConfig, admin: bool, console: Console) -> None:
        self.cfg, self.admin, self.console = cfg, admin, console
        self.live = console.is_terminal if cfg.live is None else cfg.live
        self.deployments: list[dict[str, Any]] = []
        self.training: dict[str, Any] = {}
        self.status = "running"
        self.done = False
        self._printed = 0

    async def _poll(self, sim: Simulation) -> None:
        if not self.admin:
            return
        status, body = await sim.client.get("/admin/deployments", limit=200)
        if status == 200 and isinstance(body, list):
            self.deployments = rpt.timeline(body, sim.started_at, sim.now() + 1)
        status, body = await sim.client.get("/admin/training")
        if status == 200 and isinstance(body, dict):
            self.training = body

    def _buckets(self, sim: Simulation) -> list[dict[str, Any]]:
        width = self.cfg.bucket_width_s
        upto = min(self.cfg.duration_s, sim.now())
        return rpt.bucketize(sim.records, width, max(width, upto))

    def render(self, sim: Simulation) -> Group:
        buckets = self._buckets(sim)
        table = Table(title="tabloop simulate — learning curve", expand=False)
        for col in ("t (s)", "requests", "shown/req", "accept/shown", "retained ch/100",
                    "def/class shown", "reward/req", "versions"):
            table.add_column(col, justify="right")
        for b in buckets[-12:]:
            table.add_row(f"{b['t0']:.0f}", str(b["requests"]), fmt(b["shown_per_request"]),
                          fmt(b["accept_rate_of_shown"]), fmt(b["retained_chars_per_100"], ".1f"),
                          fmt(b["family_shown_rate"]), fmt(b["reward_per_request"], ".3f"),
                          " ".join(f"v{v}:{n}" for v, n in b["versions"].items()))
        c, ev, cl = sim.counters, sim.sender.stats, sim.client.stats
        acts = {a: sum(d["action"] == a for d in self.deployments)
                for a in ("deploy", "promote", "rollback")}
        lines = [
            f"[bold]{self.status}[/] {min(sim.now(), self.cfg.duration_s):.0f}/"
            f"{self.cfg.duration_s:.0f} s · {self.cfg.users} seats · {c.people} people · "
            f"{c.away} away · {c.switches} switches · {c.churns} churned · {c.errors} errors",
            f"accept/shown {sparkline([b['accept_rate_of_shown'] for b in buckets])}   "
            f"shown/req {sparkline([b['shown_per_request'] for b in buckets], 0, 0.5)}   "
            f"def/class shown {sparkline([b['family_shown_rate'] for b in buckets], 0, 0.5)}",
            f"events {ev.sent}/{ev.queued} sent · {ev.duplicates} dup · {ev.rejected} refused · "
            f"{cl.retries} retries ({cl.throttled}×429, {cl.unavailable}×503)",
        ]
        if self.admin:
            trainer = self.training.get("trainer") or {}
            lines.append(f"deploys {acts['deploy']} · promotions {acts['promote']} · rollbacks "
                         f"{acts['rollback']} · trainer {trainer.get('state', '?')} · rewards "
                         f"finalized {self.training.get('rewards_finalized', '?')}")
        return Group(table, *[Text.from_markup(x) for x in lines])

    def _print_new_buckets(self, sim: Simulation) -> None:
        width = self.cfg.bucket_width_s
        complete = int(min(self.cfg.duration_s, sim.now()) // width)
        if self.done:
            complete = math.ceil(self.cfg.duration_s / width - 1e-9)
        buckets = self._buckets(sim)
        for b in buckets[self._printed:complete]:
            print(f"t={b['t0']:6.0f}s requests {b['requests']:4d}  shown/req "
                  f"{fmt(b['shown_per_request'])}  accept/shown "
                  f"{fmt(b['accept_rate_of_shown'])}  "
                  f"retained ch/100 {fmt(b['retained_chars_per_100'], '.1f')}  def/class shown "
                  f"{fmt(b['family_shown_rate'])}  versions "
                  + " ".join(f"v{v}:{n}" for v, n in b["versions"].items()), flush=True)
        self._printed = max(self._printed, complete)

    async def run(self, sim: Simulation) -> None:
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

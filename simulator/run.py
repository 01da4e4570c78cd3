"""`tabloop simulate`: a population of simulated editors against a running service.

    tabloop simulate --api http://127.0.0.1:8000 --key TOKEN --users 16 --minutes 10 --seed 0 \
        [--baseline-minutes 5] [--settled 0.5] [--corpus DIR] \
        [--adversaries 2 --adversary-kinds accept_all,reject_all] [--people telemetry|proxy]

Each seat holds one person (simulator.population) who types, asks for a completion at a cursor
inside a real held-out line, judges the suggestion by the code, accepts / rejects / ignores it,
reports retention at the reward spec's checks, switches models after bad runs and leaves when
suggestions stay useless (a new person takes the seat). The reward windows come from
GET /admin/reward-spec (the sim profile's defaults when the key may not read it).
With --people telemetry (the default) each person takes suggestions as real Copilot users do,
rarely short ones, and types through those too short or too slow to read
(simulator.telemetry); --people proxy gives the control, who takes almost every correct one.

With --baseline-minutes M the trainer is paused first and the live policy serves the people for
M minutes (the baseline phase), then the trainer is resumed for --minutes (the learning phase);
the report compares the learning phase's last fifth with the baseline phase (simulator.phases).

With --settled SHARE that share of people (drawn per person from the seed) report code_settled:
when they move on from a request's line — at their next request, or when they switch away,
leave or the run stops — they send what finally stands after its cursor (the held-out line's
true rest, at most 1,000 characters), shown or abstained, accepted or not, with after_seconds
counted from the request. A request is on a *fresh line* when its line's text (stripped) was
never sent before in any form: no earlier or current request's prefix or suffix held it as a
whole line, and no code_settled report finished it (simulator.population.SentLines); nothing the
workspace memory holds could recall it. The report compares fresh lines apart.

With --adversaries N the last N of the --users seats hold adversaries (simulator.population:
accept_all accepts every suggestion at once, abstentions included, and reports it fully kept;
reject_all rejects every one; random flips a coin), taking --adversary-kinds in turn. They ask
for completions ten times as often as a person, under their own user ids, and send their
feedback through their own event sender, so the report counts what the service refused of
theirs apart. The honest seats keep their numbers and seeds: their people are those of a run
with N fewer seats.
The report's `honest` and `adversaries` sections compare runs with and without them.

Order of a run: read the spec; pause the trainer (--baseline-minutes); run the people for the
baseline and learning phases while a live table shows the learning curve, resuming the trainer
in between; stop asking; let every pending decision and retention report fire and deliver them;
read the deployment timeline; run the offline baseline; write report.json, records.jsonl,
settled_lines.json and learning_curve.png under --out. A trainer the simulator paused is
resumed whatever ends the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from simulator import phases
from simulator import report as rpt
from simulator.client import ApiError, Client, EventSender
from simulator.config import Counters, SimConfig, utc_z
from simulator.display import Display
from simulator.population import (
    AdversaryKind,
    CursorSource,
    Decision,
    PersonParams,
    SentLines,
    Session,
    adversary_feedback,
    adversary_pause,
    decide,
    decision_reward,
    draw_person,
    in_reject_family,
    judge,
    line_key,
    request_context,
    retention_delays,
    seat_kinds,
    settled_text,
    settles,
    step,
    think_time,
)
from simulator.telemetry import TelemetryParams, counts_as_good, decide_telemetry, draw_telemetry
from simulator.writing import WritingSource
from tabloop.core.corpus import Cursor, usefulness

log = logging.getLogger("tabloop.simulate")


# --- the reward spec ---------------------------------------------------------------------------


async def fetch_spec(client: Client) -> tuple[dict[str, Any], str]:
    """(spec, where it came from): the service's current spec, or the sim profile's defaults when
    the key lacks the admin scope (403)."""
    from tabloop.core.reward_spec import RewardSpec

    status, body = await client.get("/admin/reward-spec")
    if status == 200 and isinstance(body, dict) and isinstance(body.get("spec"), dict):
        spec = RewardSpec.from_dict(body["spec"]).to_dict()
        return spec, f"service (version {body.get('version')})"
    if status == 403:
        return RewardSpec.sim().to_dict(), "sim defaults (the key may not read /admin/reward-spec)"
    if status == 401:
        raise ApiError(401, "the API key was refused")
    if status == 0:  # no answer, retries included
        raise ApiError(0, f"no answer from {client.api} (is the service running there?)")
    raise ApiError(status, f"GET /admin/reward-spec answered {status}: {body}")


# --- the simulation ---------------------------------------------------------------------------


def cursor_rng(seed: int, cursor: Cursor) -> random.Random:
    """A person's draws for their decision at `cursor` (when they look, whether they take it,
    edit it later): from the seed and the cursor alone, not the person's own stream.
    Every run of a seed then draws the same numbers at the same cursor, so a learning run and its
    paused control differ where their suggestions differ, not by the luck of the draw (common
    random numbers); the draws still never read what the policy computed."""
    return random.Random(f"{seed}:decide:{cursor.path}:{cursor.line_no}:{len(cursor.prefix)}")


class Simulation:
    def __init__(
        self,
        cfg: SimConfig,
        spec: dict[str, Any],
        source: CursorSource,
        client: Client,
        sender: EventSender,
        trainer: phases.TrainerControl | None = None,
        writing: WritingSource | None = None,
    ) -> None:
        self.cfg, self.spec, self.source = cfg, spec, source
        self.writing = writing  # writing mode's files (None: retyping anywhere)
        self.client, self.sender = client, sender
        # the adversaries' own sender: what the service refused of theirs is counted apart
        self.adversary_sender = EventSender(
            client, batch_size=cfg.event_batch_size, flush_interval_s=cfg.flush_interval_s
        )
        self.kinds = seat_kinds(cfg.users, cfg.adversaries, cfg.adversary_kinds)
        self.trainer = trainer  # resumed when the baseline phase ends (None: no baseline phase)
        self.records: list[rpt.RequestRecord] = []
        self.counters = Counters()
        self.settled_lines: set[tuple[str, int]] = set()  # (path, line) with a code_settled sent
        self.sent = SentLines()  # what decides whether a request is on a fresh line
        self.stop = asyncio.Event()  # people stop asking
        self.interrupted = asyncio.Event()  # Ctrl-C: end early, still deliver and report
        self.duration_s = cfg.duration_s  # shortened when interrupted
        self.pending_reports = 0
        self.started_at = datetime.now(UTC)
        self._t0 = time.monotonic()
        # feedback must reach the service inside its windows: decide (and deliver) in time
        self.margin_s = 2 * cfg.flush_interval_s + 0.5
        self.max_delay_s = max(0.3, float(spec["decision_window_s"]) - self.margin_s)

    def now(self) -> float:
        return time.monotonic() - self._t0

    @property
    def phase(self) -> phases.Phase:
        return phases.phase_at(self.now(), self.cfg.baseline_s)

    def _event(self, type_: str, user_id: str, **fields: Any) -> dict[str, Any]:
        # the sender gives it its event_id when it is added
        return {"type": type_, "user_id": user_id, "occurred_at": utc_z(), **fields}

    def _later(self, delay_s: float, make: Callable[[], dict[str, Any]]) -> None:
        """Send an event made `delay_s` from now (a retention check); counted until sent."""
        self.pending_reports += 1

        def fire() -> None:
            self.pending_reports -= 1
            self.sender.add(make())
            self.counters.retention_reports += 1

        asyncio.get_running_loop().call_later(delay_s, fire)

    async def _complete(
        self, user_id: str, cursor: Cursor, prefix: str, suffix: str
    ) -> tuple[dict[str, Any] | None, bool]:
        """One POST /v1/complete for a person at `cursor` (None when it failed), and whether the
        cursor's line is fresh: its text never sent before, this request included."""
        limit = 200_000 if self.writing else 8000  # a writer sends the whole file above
        self.sent.add_request(
            prefix[-limit:],
            suffix[:2000],
            prefix_cut=len(prefix) > limit,
            suffix_cut=len(suffix) > 2000,
        )
        fresh = self.sent.fresh(cursor)
        resp = await self.client.complete(
            {
                "user_id": user_id,
                "session_id": f"{user_id}-s",
                "workspace_id": "sim",
                "language": "python",
                "file_path": cursor.path.name,
                "prefix": prefix[-limit:],
                "suffix": suffix[:2000],
                "max_new_tokens": self.cfg.max_new_tokens,
            }
        )
        return resp, fresh

    async def _pause(self, seconds: float) -> None:
        """Sleep, cut short when the run stops."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    async def seat(self, slot: int) -> None:
        """One seat: a person until they churn, then the next one (or an adversary)."""
        kind = self.kinds[slot]
        if kind is not None:
            await self.adversary(slot, kind)
            return
        generation = 0
        while not self.stop.is_set():
            rng = random.Random(f"{self.cfg.seed}:{slot}:{generation}")
            person = draw_person(self.cfg.population, rng)
            # drawn after the person, so proxy people draw exactly what they always drew
            habits = (
                draw_telemetry(self.cfg.telemetry, rng) if self.cfg.people == "telemetry" else None
            )
            self.counters.people += 1
            opted_in = settles(self.cfg.seed, slot, generation, self.cfg.settled_share)
            self.counters.settled_people += opted_in
            user_id = f"sim{self.cfg.seed}-{slot}-{generation}"
            if await self.person(user_id, person, rng, opted_in, habits) != "churn":
                return
            generation += 1

    async def person(
        self,
        user_id: str,
        person: PersonParams,
        rng: random.Random,
        opted_in: bool = False,
        habits: TelemetryParams | None = None,
    ) -> str:
        """One person until they leave ("churn") or the run stops; `habits`: a telemetry
        person's (None: a proxy person)."""
        session = Session()
        took_last = False  # a telemetry person's momentum: they took the last one shown
        # the last request's line, reported (code_settled) when the person moves on from it
        unsettled: tuple[str, Cursor, float] | None = None

        def move_on() -> None:
            nonlocal unsettled
            if unsettled is not None:
                self._settle(user_id, *unsettled)
                unsettled = None

        while True:
            await self._pause(think_time(person, rng))
            move_on()
            if self.stop.is_set():
                return "stop"
            if self.writing is not None:
                cursor = self.writing.draw(user_id, rng)
            else:
                cursor = self.source.draw(rng, self.cfg.population.reject_family_share)
            prefix, suffix = request_context(cursor)
            family = in_reject_family(prefix)
            t = self.now()
            resp, fresh = await self._complete(user_id, cursor, prefix, suffix)
            if resp is None:
                self.counters.errors += 1
                continue
            # all a person sees of the response: the text shown and how long it took, never
            # what the policy computed (tests/simulator/test_telemetry.py checks this call)
            text = resp["text"] if resp["shown"] else ""
            latency_ms = float(resp.get("latency_ms", 0.0))
            shown_at = self.now()
            decision = None
            if resp["shown"] and text:
                draws = cursor_rng(self.cfg.seed, cursor)
                if habits is None:  # a proxy person
                    decision = decide(
                        person,
                        text,
                        cursor.truth_after(text.count("\n")),
                        family,
                        self.max_delay_s,
                        draws,
                    )
                else:  # a telemetry person
                    decision = decide_telemetry(
                        person,
                        habits,
                        text,
                        cursor.truth_after(text.count("\n")),
                        prefix=prefix,
                        latency_ms=latency_ms,
                        after_accept=took_last,
                        max_delay_s=self.max_delay_s,
                        rng=draws,
                    )
            self._record(t, user_id, resp, family, text, decision, cursor, fresh)
            if opted_in:
                unsettled = (resp["suggestion_id"], cursor, t)
            if decision is None:
                continue
            await asyncio.sleep(decision.delay_s)  # looking at it; finishes even when stopping
            self._feedback(user_id, resp["suggestion_id"], decision, self.now() - shown_at)
            took_last = decision.action == "accept"
            good = took_last if habits is None else counts_as_good(decision)
            if good is None:
                continue  # typed through unread: nothing to judge the model by
            session, move = step(session, person, good)
            if move != "stay":
                move_on()  # leaving the editor: the line stands as it is
            if move == "switch":
                self.counters.switches += 1
                self.sender.add(
                    self._event(
                        "model_switch", user_id, from_model="tabloop", to_model="another-model"
                    )
                )
                self.counters.away += 1
                await self._pause(person.switch_away_s)
                self.counters.away -= 1
            elif move == "churn":
                self.counters.churns += 1
                self.sender.add(self._event("churn", user_id, reason="suggestions stayed useless"))
                return "churn"

    async def adversary(self, slot: int, kind: AdversaryKind) -> None:
        """An adversary in seat `slot`: asks ten times as often as a person and sends its verdict
        on every suggestion at once, whatever the code (simulator.population)."""
        rng = random.Random(f"adversary:{self.cfg.seed}:{slot}")
        pace = draw_person(self.cfg.population, rng)  # its pace and its eye for close code
        user_id = f"sim{self.cfg.seed}-adversary-{slot}"
        self.counters.adversaries += 1
        horizon = float(self.spec["horizon_s"])
        checks = [float(c) for c in self.spec["retention_checks_s"] if float(c) <= horizon]
        while not self.stop.is_set():
            await self._pause(adversary_pause(pace, rng))
            if self.stop.is_set():
                return
            cursor = self.source.draw(rng, self.cfg.population.reject_family_share)
            prefix, suffix = request_context(cursor)
            t = self.now()
            resp, fresh = await self._complete(user_id, cursor, prefix, suffix)
            if resp is None:
                self.counters.errors += 1
                continue
            text = resp["text"] if resp["shown"] else ""
            sent = adversary_feedback(kind, bool(resp["shown"]), text, checks, rng)
            accepted = sent[0]["type"] == "accept"
            for event in sent:
                fields = {k: v for k, v in event.items() if k != "type"}
                self.adversary_sender.add(
                    self._event(
                        event["type"], user_id, suggestion_id=resp["suggestion_id"], **fields
                    )
                )
            decision = None
            if resp["shown"] and text:
                decision = Decision(
                    judge(text, cursor.truth_after(text.count("\n")), pace.close_similarity),
                    "accept" if accepted else "reject",
                    0.0,
                    len(text) if accepted else 0,
                    1.0 if accepted else 0.0,
                )
            self._record(
                t,
                user_id,
                resp,
                in_reject_family(prefix),
                text,
                decision,
                cursor,
                fresh,
                adversary=kind,
            )

    def _settle(self, user_id: str, suggestion_id: str, cursor: Cursor, t: float) -> None:
        """Report what finally stands after the cursor of the request sent at `t`."""
        self.sender.add(
            self._event(
                "code_settled",
                user_id,
                suggestion_id=suggestion_id,
                after_seconds=round(max(0.0, self.now() - t), 3),
                text=settled_text(cursor),
            )
        )
        self.settled_lines.add(line_key(cursor))
        self.sent.add_settled(cursor)
        self.counters.settled += 1

    def _record(
        self,
        t: float,
        user_id: str,
        resp: dict[str, Any],
        family: bool,
        text: str,
        decision: Decision | None,
        cursor: Cursor,
        fresh: bool,
        adversary: str | None = None,
    ) -> None:
        accepted = decision is not None and decision.action == "accept"
        chars = decision.accepted_chars if decision is not None and accepted else 0
        useful, whole = usefulness(text, cursor.truth_after(text.count("\n")))
        self.records.append(
            rpt.RequestRecord(
                t=round(t, 3),
                user_id=user_id,
                version=int(resp["policy_version"]),
                shown=decision is not None,
                family=family,
                shown_chars=len(text),
                verdict=decision.verdict if decision else None,
                action=decision.action if decision else "abstained",
                accepted_chars=chars,
                retained_chars=chars * decision.retained_fraction if decision and accepted else 0.0,
                reward=decision_reward(self.spec, len(text), decision),
                latency_ms=float(resp.get("latency_ms", 0.0)),
                phase=phases.phase_at(t, self.cfg.baseline_s),
                fresh=fresh,
                path=str(cursor.path),
                line_no=cursor.line_no,
                adversary=adversary,
                useful_chars=useful,
                whole_line=whole,
                shown_lines=text.count("\n") + 1 if decision is not None else 0,
                expected_kept=decision.expected_kept if decision is not None else 0.0,
            )
        )

    def _feedback(self, user_id: str, suggestion_id: str, d: Decision, after_s: float) -> None:
        if d.action == "ignore":
            return  # the decision window passes silently
        if d.action == "reject":
            self.sender.add(self._event("reject", user_id, suggestion_id=suggestion_id))
            return
        self.sender.add(
            self._event(
                "accept", user_id, suggestion_id=suggestion_id, accepted_chars=d.accepted_chars
            )
        )
        kept = round(d.retained_fraction, 4)
        for check in retention_delays(self.spec, after_s, self.margin_s):
            self._later(check, self._retention(user_id, suggestion_id, check, kept))

    def _retention(
        self, user_id: str, suggestion_id: str, after_s: float, fraction: float
    ) -> Callable[[], dict[str, Any]]:
        """Makes the code_retained event at check time (its occurred_at is when it fires)."""
        return lambda: self._event(
            "code_retained",
            user_id,
            suggestion_id=suggestion_id,
            after_seconds=after_s,
            retained_fraction=fraction,
        )

    def _end_early_on_error(self, task: asyncio.Task[None]) -> None:
        """A seat or the sender failed (a refused key, a bug): end the run now, not at its end."""
        if not task.cancelled() and task.exception() is not None:
            self.interrupted.set()

    async def end_baseline_phase(self) -> None:
        """At the end of the baseline phase, resume the trainer (if the simulator paused it)."""
        await self._pause(self.cfg.baseline_s - self.now())
        if self.trainer is not None and not self.stop.is_set():
            await self.trainer.resume(self.now())

    async def run(self, display: Display) -> None:
        sender_stop = asyncio.Event()
        sender_task = asyncio.create_task(self.sender.run(sender_stop))
        adversary_task = asyncio.create_task(self.adversary_sender.run(sender_stop))
        # the seats, and the switch from the baseline phase to the learning phase
        seats = [asyncio.create_task(self.seat(i)) for i in range(self.cfg.users)]
        seats.append(asyncio.create_task(self.end_baseline_phase()))
        for task in (sender_task, adversary_task, *seats):
            task.add_done_callback(self._end_early_on_error)
        display_task = asyncio.create_task(display.run(self))
        try:
            try:
                await asyncio.wait_for(self.interrupted.wait(), self.cfg.duration_s)
                self.duration_s = min(self.cfg.duration_s, max(1.0, self.now()))
            except TimeoutError:
                pass
            self.stop.set()
            # people finish what they are looking at (bounded by the decision window)
            _, late = await asyncio.wait(seats, timeout=self.max_delay_s + 60)
            for task in late:
                task.cancel()
            for task in (sender_task, adversary_task, *seats):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            deadline = time.monotonic() + float(self.spec["horizon_s"]) + 5
            while self.pending_reports and time.monotonic() < deadline:
                display.status = f"delivering the last retention reports ({self.pending_reports})"
                await asyncio.sleep(0.25)
            for sender in (self.sender, self.adversary_sender):
                if not await sender.drain(60):
                    log.error("%d events could not be delivered", sender.pending)
        finally:
            sender_stop.set()
            for task in (sender_task, adversary_task):
                if not task.done():
                    await task
            display.done = True
            await display_task

"""The trainer's loop: consume, join, finalize rewards, commit, then train or watch the canary.

Always in the same order: poll the log; add records to the join; write the rewards
that are final; commit offsets (what was read is durable: rollouts and events are in the
database and rewards were just written); heartbeat; then, unless paused, either judge the
canary in flight or — with a full batch of untrained rewards from recent versions — take a
policy-gradient step, gate the candidate, register it and deploy it as a canary.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa
import torch
from kafka.errors import KafkaError

from tabloop.core.config import Settings
from tabloop.core.policy.checkpoint import save_checkpoint
from tabloop.core.policy.device import resolve
from tabloop.core.policy.tokenizer import CodeTokenizer
from tabloop.core.registry import Deployment, current_deployment
from tabloop.core.retention import code_cutoff
from tabloop.core.reward_store import current_spec
from tabloop.core.settled import settled_texts
from tabloop.core.status import HistoryEntry, TrainerStatus
from tabloop.core.stream.consumer import open_consumer
from tabloop.core.stream.topics import FEEDBACK, ROLLOUTS
from tabloop.core.tables import TRAINER_STATE_NAME as STATE_NAME
from tabloop.core.tables import (
    reward_specs,
    trainer_state,
    utcnow,
)
from trainer import store
from trainer.blocks import block_labels
from trainer.canary import ArmStats, arm_stats, canary_verdict
from trainer.candidate import split_for_check, train_candidate
from trainer.caps import cap_weights, capped
from trainer.client import ApiError, ServiceClient
from trainer.config import TrainerConfig
from trainer.deploy_check import check
from trainer.distributed import RankFailed, UpdatePool
from trainer.join import Join
from trainer.membership import Membership, upsert_state
from trainer.metrics import (
    BATCH_FILL,
    CANARY_VERDICTS,
    GATE_RESULTS,
    JOIN_LAG,
    PENDING,
    UPDATES,
)
from trainer.policies import Policies
from trainer.update import Batch

log = logging.getLogger(__name__)

CAPPED_BATCHES = 50  # batches whose capped people and keys the state keeps (trainer_state.info)
HISTORY = 50  # the trainer's decisions the state keeps
CAPPED_LISTED = 20  # the most capped people (and keys) kept per batch, most weight removed first


class Trainer:
    def __init__(
        self,
        settings: Settings,
        engine: sa.Engine,
        client: ServiceClient,
        cfg: TrainerConfig | None = None,
        pool: UpdatePool | None = None,
    ) -> None:
        """`pool`: the ranks of a data-parallel update (torchrun's: UpdatePool.from_env());
        else, with cfg.nproc > 1, the trainer starts its own at its first update."""
        self.settings, self.engine, self.client = settings, engine, client
        self.cfg = cfg or TrainerConfig.for_settings(settings)
        self.pool = pool
        self.state = TrainerStatus()
        self._last_heartbeat = 0.0
        self._canary_due = 0.0  # monotonic time of the next reading of a canary's arms
        self.paused = False
        self.horizon = timedelta(0)  # the reward spec's, set when the loop starts
        self._optimizer_state: dict[str, Any] | None = None  # Adam's moments, kept across updates
        self.membership = Membership(settings, engine, self.cfg.group, self.state)
        self.lock = self.membership.lock
        self.device = resolve(settings.device)  # where updates and checks compute
        self.policies = Policies(settings, engine, self.device, self.cfg)

    # -- the loop --------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Run until `stop`. A database, broker or API outage restarts the loop from what is
        durable (rewards in the database, committed offsets), as a restarted process would,
        instead of ending the process."""
        torch.set_num_threads(self.settings.torch_threads)
        backoff = 1.0
        while not stop.is_set():
            started = time.monotonic()
            try:
                self._run(stop)
            except (sa.exc.SQLAlchemyError, KafkaError, OSError, httpx.HTTPError, ApiError) as e:
                if time.monotonic() - started > 60:
                    backoff = 1.0
                self.state.state = "retrying"
                log.warning(
                    "trainer: %s: %s; restarting from the committed offsets in %.0f s",
                    type(e).__name__,
                    str(e).split("\n")[0],
                    backoff,
                )
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
        self.lock.release()
        if self.pool is not None:
            self.pool.close()

    def _run(self, stop: threading.Event) -> None:
        partitioned = not self.settings.embedded
        if not partitioned and not self.lock.acquire(stop):  # the outbox: one process joins
            return
        spec_version, spec = current_spec(self.engine, self.settings.profile)
        join = Join(self.engine, spec, spec_version)
        self.horizon = timedelta(seconds=spec.horizon_s)
        if partitioned:  # each member joins the people of its partitions (Join.recover on them)
            consumer = self.membership.open(join)
            log.info("trainer starting as a member of consumer group %s", self.cfg.group)
        else:
            recovered = join.recover()
            log.info(
                "trainer starting: %d rollouts pending from before, reward spec v%d",
                recovered,
                spec_version,
            )
            consumer = open_consumer(
                self.settings, self.engine, self.cfg.group, [ROLLOUTS, FEEDBACK]
            )
        try:
            while not stop.is_set():
                records = consumer.poll(max_records=5000, timeout_s=self.cfg.poll_timeout_s)
                join.add(records)
                join.finalize_due()
                consumer.commit(records)
                if self._heartbeat(join):
                    self._follow_spec(join)
                if self.paused or not self.membership.leading:
                    continue
                with self.engine.connect() as conn:
                    dep = current_deployment(conn)
                if dep is None:
                    continue
                if dep.canary_version is not None:
                    if time.monotonic() >= self._canary_due:
                        self._canary_due = time.monotonic() + self.cfg.canary_poll_s
                        self._watch_canary(dep)
                else:
                    self._maybe_train(dep)
        finally:
            consumer.close()
        self.state.state = "stopped"
        self._heartbeat(join, force=True)
        self.membership.leave()
        log.info("trainer stopped")

    # -- training --------------------------------------------------------------------------
    def _code_kept(self) -> list[Any]:
        """SQL conditions: the rollout's code is still stored (tabloop/core/retention.py)."""
        return store.code_kept(code_cutoff(self.settings, self.horizon.total_seconds(), utcnow()))

    def _replay_rows(self) -> list[sa.Row]:
        """Shown rollouts already trained on, newest first, for the gate's fit (gate_fit) and
        the lines head's (lines_fit)."""
        fits = self.cfg.update.gate_fit or self.cfg.update.lines_fit
        if not fits or self.cfg.update.gate_fit_replay <= 0:
            return []
        limit = self.cfg.update.gate_fit_replay
        return store.trained_rows(self.engine, limit, store.shown(), *self._code_kept())

    def _settled_replay_rows(self) -> list[sa.Row]:
        """Rollouts already trained on that have a settled text, newest first: the supervised
        term reads them again (settled_replay), each with its own text only."""
        limit = self.cfg.update.settled_replay
        if not self.cfg.update.settled_epochs or limit <= 0:
            return []
        return store.trained_rows(self.engine, limit, store.has_settled_text(), *self._code_kept())

    def _weights(self, rows: list[sa.Row]) -> list[float]:
        """Each row's weight: no person or key above cfg.max_share of the rows' total."""
        return cap_weights(
            [r.user_id for r in rows], [r.api_key_id for r in rows], self.cfg.max_share
        )

    def _blocks(self, rows: list[sa.Row], tokenizer: CodeTokenizer) -> list[float | None] | None:
        """Each row's block label (trainer/blocks.py); None when the lines fit is off."""
        return block_labels(self.engine, tokenizer, rows) if self.cfg.update.lines_fit else None

    def _with_settled(self, rows: list[sa.Row], tokenizer: CodeTokenizer | None = None) -> Batch:
        """The rows as a batch, capped (`_weights`), each with the text its person settled on
        (None: no report, or the settled-text term is off and nothing is read) and, given the
        `tokenizer`, its block label (the lines fit reads them; the settled term does not)."""
        texts = (
            settled_texts(self.engine, suggestion_ids=[r.suggestion_id for r in rows])
            if self.cfg.update.settled_epochs
            else {}
        )
        return Batch.of(
            rows,
            [r.value for r in rows],
            [texts.get(r.suggestion_id) for r in rows],
            self._weights(rows),
            None if tokenizer is None else self._blocks(rows, tokenizer),
            [float(r.kept_chars) for r in rows],
        )

    def _batch_rows(self) -> list[sa.Row]:
        return store.untrained_rows(
            self.engine,
            self.cfg.staleness,
            utcnow() - self.horizon,
            self.cfg.batch_size * self.cfg.max_batch_factor,
            *self._code_kept(),
        )

    def _maybe_train(self, dep: Deployment) -> None:
        rows = self._batch_rows()
        self.state.state, self.state.batch_size = "collecting", self.cfg.batch_size
        self.state.batch_fill = len(rows)
        if len(rows) < self.cfg.batch_size:
            return
        self.state.state = "updating"
        started = time.monotonic()
        values = torch.tensor([r.value for r in rows])
        if float(values.std()) < 1e-6:  # every reward equal: no advantage, nothing to learn
            store.stamp_trained(self.engine, [r.suggestion_id for r in rows], None)
            self._remember("skipped", dep.live_version, f"all {len(rows)} rewards equal")
            return
        live_model, tokenizer = self.policies.get(dep.live_version)
        # a policy that holds its own KL reference (a LoRA adapter's base) needs no second model
        ref_model = (
            live_model
            if live_model.holds_reference
            else self.policies.get(self.policies.base_version(dep.live_version))[0]
        )
        rows.sort(key=lambda r: r.suggestion_id)  # random uuids: an unbiased train/gate split
        train_rows, gate_rows = split_for_check(rows, self.cfg.gate_fraction)
        batch = self._with_settled(train_rows, tokenizer)
        earlier = self._replay_rows()
        replay = (
            Batch.of(
                earlier,
                [r.value for r in earlier],
                weights=self._weights(earlier),
                blocks=self._blocks(earlier, tokenizer),
                kept=[float(r.kept_chars) for r in earlier],
            )
            if earlier
            else None
        )
        earlier_settled = self._settled_replay_rows()
        settled = self._with_settled(earlier_settled) if earlier_settled else None
        generic = (
            self.policies.generic(tokenizer, live_model)
            if self.cfg.update.generic_mix > 0
            else None
        )
        parallel = self.cfg.nproc > 1 or self.pool is not None
        if parallel and not live_model.distributable:
            # the ranks rebuild the built-in model from its config; an adapter on a Hugging
            # Face base updates here (on a GPU, one process is the usual way to run it)
            log.warning("this policy updates in one process: --nproc is ignored")
        pool = self._update_pool() if parallel and live_model.distributable else None
        try:
            candidate = train_candidate(
                live_model,
                ref_model,
                tokenizer,
                batch,
                self.cfg.update,
                self._optimizer_state,
                replay,
                settled,
                generic,
                pool,
            )
        except RankFailed as e:
            # the candidate is half-stepped: dropped, nothing registered or stamped; the next
            # round starts new ranks and trains on the same rollouts
            log.warning("the data-parallel update failed (%s); the next round retries", e)
            self._remember("update_failed", dep.live_version, str(e).split("\n")[0][:300])
            self.state.state = "collecting"
            return
        model, metrics = candidate.model, candidate.metrics
        self._optimizer_state = candidate.optimizer_state
        UPDATES.inc()
        self.state.state = "gating"
        result = check(
            model,
            live_model,
            tokenizer,
            self.policies.heldout(tokenizer, model),
            gate_rows,
            torch.tensor([r.logprob_total for r in gate_rows]),
            torch.tensor([r.value for r in gate_rows]),
            self.cfg.deploy_check,
            base=ref_model,
            weights=torch.tensor(self._weights(gate_rows)),
            kept=torch.tensor([float(r.kept_chars) for r in gate_rows]),
        )
        ids = [r.suggestion_id for r in train_rows]
        now = utcnow()
        store.stamp_trained(self.engine, ids, None)  # before registering: never trained on twice
        summary = {
            "parent": dep.live_version,
            "rollouts": len(train_rows),
            "mean_reward": float(batch.rewards.mean()),
            "update": metrics,
            "gate": result.to_dict(),
            "caps": self._record_caps(train_rows, now),
            "seconds": round(time.monotonic() - started, 2),
        }
        self.state.last_update = {"at": now.isoformat(), **summary}
        self.state.last_gate = result.to_dict()
        GATE_RESULTS.labels(result="passed" if result.passed else "failed").inc()
        if not result.passed:
            log.info(
                "candidate from v%d failed the deploy check: %s", dep.live_version, result.reason
            )
            self._remember("gate_failed", dep.live_version, result.reason)
            return
        with tempfile.TemporaryDirectory(prefix="tabloop-candidate-") as tmp:
            ckpt = save_checkpoint(
                Path(tmp),
                model,
                tokenizer,
                version=0,
                parent=dep.live_version,
                summary=summary,
                overwrite=True,
                languages=self.policies.languages[dep.live_version],
            )
            version = self.client.register(ckpt, dep.live_version, summary)
        store.stamp_trained(self.engine, ids, version)
        self.client.deploy(
            version,
            self.cfg.canary_fraction,
            reason=f"trainer: gate passed ({result.reason}); canary",
        )
        fit = (
            f", gate fit on {metrics['gate_fit/shown']:.0f} shown verdicts,"
            f" sharpness {metrics['gate_fit/sharpness']:.1f}"
            if metrics.get("gate_fit/fitted")
            else ""
        )
        if metrics.get("lines_fit/fitted"):
            fit += (
                f", lines fit on {metrics['lines_fit/labels']:.0f} blocks"
                f" ({100 * metrics['lines_fit/stands']:.0f}% stand)"
            )
        log.info(
            "candidate v%d (from v%d, %d rollouts, mean reward %.3f%s) gated and deployed as "
            "a %.0f%% canary",
            version,
            dep.live_version,
            len(train_rows),
            summary["mean_reward"],
            fit,
            100 * self.cfg.canary_fraction,
        )
        self._remember("canary", version, result.reason)
        self.state.state = "canary"

    def _update_pool(self) -> UpdatePool:
        """The update's ranks, started at the first update (the workers import torch)."""
        if self.pool is None:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            log.info("starting %d data-parallel update ranks (%s)", self.cfg.nproc, backend)
            self.pool = UpdatePool(
                self.cfg.nproc,
                threads_per_rank=self.settings.torch_threads,
                device=self.device.type,
            )
        return self.pool

    def _record_caps(self, rows: list[sa.Row], now: Any) -> dict[str, Any]:
        """Who was capped in this batch: kept in the state (the last CAPPED_BATCHES batches,
        read by GET /admin/metrics), summed up for the candidate's training summary. From the
        weights in float64 (the batch holds them in float32, whose rounding over a few hundred
        rows can look like a cap of a millionth of a row)."""
        weights = self._weights(rows)
        users = capped([r.user_id for r in rows], weights)
        keys = capped([r.api_key_id for r in rows], weights)
        entry = {
            "at": now.isoformat(),
            "rollouts": len(rows),
            "max_share": self.cfg.max_share,
            "users": [c.to_dict() for c in users[:CAPPED_LISTED]],
            "keys": [c.to_dict() for c in keys[:CAPPED_LISTED]],
        }
        self.state.capped = [*self.state.capped, entry][-CAPPED_BATCHES:]
        return {
            "max_share": self.cfg.max_share,
            "users_capped": len(users),
            "keys_capped": len(keys),
            "weight_removed": round(sum(c.weight_removed for c in users + keys), 3),
        }

    # -- canary ----------------------------------------------------------------------------

    def _arm(self, conn: sa.Connection, version: int, since: Any) -> ArmStats:
        """The arm's finalized rewards since `since`, capped per person and key like a batch."""
        rows = store.arm_rows(conn, version, since)
        return arm_stats(
            [r.value for r in rows],
            [r.outcome for r in rows],
            [r.user_id for r in rows],
            [r.api_key_id for r in rows],
            self.cfg.max_share,
            [float(r.kept_chars) for r in rows],
        )

    def _watch_canary(self, dep: Deployment) -> None:
        assert dep.canary_version is not None
        with self.engine.connect() as conn:
            canary = self._arm(conn, dep.canary_version, dep.created_at)
            live = self._arm(conn, dep.live_version, dep.created_at)
        age = (utcnow() - dep.created_at).total_seconds()
        verdict, why = canary_verdict(canary, live, age, self.cfg.canary)
        self.state.state = "canary"
        self.state.canary = {
            "version": dep.canary_version,
            "age_s": age,
            "canary": asdict(canary),
            "live": asdict(live),
        }
        if verdict == "wait":
            return
        try:
            if verdict == "promote":
                self.client.promote(dep.canary_version, reason=f"trainer: {why}")
            else:
                self.client.rollback(reason=f"trainer: {why}", canary_version=dep.canary_version)
        except ApiError as e:
            if e.status != 409:  # not an operator's move (the service is away): retried
                raise
            # an operator acted first: the next round sees what they did
            log.warning("canary %s of v%d not applied: %s", verdict, dep.canary_version, e)
            return
        log.info("canary v%d: %s (%s)", dep.canary_version, verdict, why)
        CANARY_VERDICTS.labels(verdict=verdict).inc()
        self._remember(verdict, dep.canary_version, why)

    # -- helpers ---------------------------------------------------------------------------

    def _remember(self, event: str, version: int, why: str) -> None:
        entry = HistoryEntry(at=utcnow().isoformat(), event=event, version=version, reason=why)
        self.state.history = [*self.state.history, entry][-HISTORY:]

    def _follow_spec(self, join: Join) -> None:
        """Pick up a reward spec put since the last look (the check is one indexed max())."""
        with self.engine.connect() as conn:
            newest = conn.execute(sa.select(sa.func.max(reward_specs.c.version))).scalar()
        if newest is None or newest == join.spec_version:
            return
        old = join.spec_version
        version, spec = current_spec(self.engine, self.settings.profile)
        join.set_spec(spec, version)
        self.horizon = timedelta(seconds=spec.horizon_s)
        self.state.reward_spec_version = version
        log.info("reward spec v%d in use from now on (was v%d)", version, old)

    def _heartbeat(self, join: Join, force: bool = False) -> bool:
        """At most every heartbeat_s: settle who leads, write this member's row and, when
        leading, the trainer's state row; True when it did."""
        if not force and time.monotonic() - self._last_heartbeat < self.cfg.heartbeat_s:
            return False
        self._last_heartbeat = time.monotonic()
        if not force:
            if self.settings.embedded:
                self.lock.check()  # lost with its connection: a standby may be active; restart
            else:
                self.membership.lead()
        oldest = min((p.rollout.created_at for p in join.pending.values()), default=None)
        joined: dict[str, Any] = dict(
            pending=len(join.pending),
            finalized=join.stats.finalized,
            finalized_elsewhere=join.stats.finalized_elsewhere,
            late_events=join.stats.late_events,
            bad_records=join.stats.bad_records,
            join_lag_s=(utcnow() - oldest).total_seconds() if oldest else 0.0,
        )
        for name, value in joined.items():
            setattr(self.state, name, value)
        PENDING.set(len(join.pending))
        JOIN_LAG.set(joined["join_lag_s"])
        BATCH_FILL.set(self.state.batch_fill)
        now = utcnow()
        with self.engine.begin() as conn:
            if not self.settings.embedded:
                self.membership.write_row(conn, joined, now)
            if not self.membership.leading:
                return True
            row = conn.execute(
                sa.select(trainer_state.c.paused).where(trainer_state.c.name == STATE_NAME)
            ).first()
            self.paused = bool(row and row.paused)
            if self.paused:
                self.state.state = "paused"
            upsert_state(
                conn, STATE_NAME, heartbeat_at=now, info=self.state.model_dump(mode="json")
            )
        return True

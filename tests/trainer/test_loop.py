"""The trainer end to end: a running service, rollouts and feedback in, rewards finalized for
every rollout, a candidate trained, gated, canaried and judged — and a kill -9 that loses no
reward and trains on no rollout twice."""

from __future__ import annotations

import datetime as dt
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tabloop.core.config import Settings
from tabloop.core.db import make_engine, upgrade
from tabloop.core.keys import create_key
from tabloop.core.registry import bootstrap
from tabloop.core.tables import deployments, policies, rewards, rollouts
from tabloop.testing.procs import stop_process
from tests.service.conftest import RunningService, make_settings
from trainer.canary import CanaryConfig
from trainer.client import ServiceClient
from trainer.deploy_check import CheckConfig
from trainer.loop import Trainer, TrainerConfig
from trainer.policies import lineage_root
from trainer.update import UpdateConfig

# a deploy check every candidate passes: these tests are about the loop, not the gate
PASSING_CHECK = CheckConfig(
    max_heldout_regression=1.0, max_reward_drop=1.0, min_ess=1.0, min_ess_fraction=0.0, kept_z=1e6
)
PREFIXES = [
    "import os\nimport ",
    "def f(x):\n    return ",
    "for i in range(",
    "class A(object):\n    def __init__(self",
    "if __name__ == '__main__':\n    ",
]


def now_z() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


def drive(
    url: str,
    token: str,
    n: int,
    seed: int,
    settled: bool = False,
    versions: list[int] | None = None,
) -> list[str]:
    """n completions from 12 users; accept shown suggestions that end a call, reject others;
    with `settled`, a code_settled report for every request (shown or not); `versions`
    collects the policy version that served each."""
    rng = random.Random(seed)
    ids = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        for i in range(0, n, 10):
            evs = []
            for _ in range(min(10, n - i)):
                user = f"u{rng.randrange(12)}"
                r = c.post(
                    "/v1/complete",
                    json={"user_id": user, "prefix": rng.choice(PREFIXES), "max_new_tokens": 8},
                )
                assert r.status_code == 200, r.text
                body = r.json()
                ids.append(body["suggestion_id"])
                if versions is not None:
                    versions.append(body["policy_version"])
                if settled:
                    evs.append(
                        {
                            "event_id": str(uuid.uuid4()),
                            "type": "code_settled",
                            "user_id": user,
                            "suggestion_id": body["suggestion_id"],
                            "occurred_at": now_z(),
                            "after_seconds": 1.5,
                            "text": "x)",
                        }
                    )
                if body["shown"]:
                    good = body["text"].rstrip().endswith((")", ":"))
                    evs.append(
                        {
                            "event_id": str(uuid.uuid4()),
                            "type": "accept" if good else "reject",
                            "user_id": user,
                            "suggestion_id": body["suggestion_id"],
                            "occurred_at": now_z(),
                        }
                    )
            if evs:
                assert c.post("/v1/events", json={"events": evs}).status_code == 202
    return ids


def wait_for(pred: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def count(engine: sa.Engine, table: sa.Table, *where: Any) -> int:
    with engine.connect() as conn:
        return conn.execute(
            sa.select(sa.func.count()).select_from(table).where(*where)
        ).scalar_one()


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[tuple[Settings, RunningService, str, str]]:
    settings = make_settings(
        tmp_path,
        profile="sim",
        policy_poll_interval_s=0.2,
        rate_limit_per_s=10_000,
        rate_limit_burst=10_000,
    )
    upgrade(settings)
    engine = make_engine(settings)
    with engine.begin() as conn:
        bootstrap(conn, settings.base_checkpoint)  # the shipped, pretrained base policy
        ingest = create_key(conn, name="t", scopes=frozenset({"ingest", "admin"}))[1]
        deploy = create_key(conn, name="trainer", scopes=frozenset({"deploy"}))[1]
    engine.dispose()
    svc = RunningService(settings).start()
    yield settings, svc, ingest, deploy
    svc.stop()


def test_rewards_finalized_and_a_candidate_is_gated_canaried_and_judged(embedded: Any) -> None:
    settings, svc, ingest, deploy = embedded
    cfg = TrainerConfig(
        batch_size=60,
        canary_fraction=0.5,
        canary=CanaryConfig(
            min_rollouts=20, timeout_s=60, reward_tolerance=1.0, accept_tolerance=1.0
        ),
        deploy_check=PASSING_CHECK,
        poll_timeout_s=0.2,
        canary_poll_s=0.6,  # the arms are read at most this often, not at every poll
        max_share=0.05,  # below 1/12: each of the 12 people is held to a twelfth of a batch
        # the gate's fit on the shown verdicts (the sim profile's), on however few there are,
        # and the supervised term on settled text with its replay
        update=UpdateConfig(
            gate_fit=True, gate_fit_min_shown=0, settled_epochs=1, settled_replay=1000
        ),
    )
    engine = make_engine(settings)
    stop = threading.Event()
    trainer = Trainer(settings, engine, ServiceClient(svc.url, deploy), cfg)
    readings: list[float] = []  # when the trainer read the canary's arms
    watch = trainer._watch_canary
    trainer._watch_canary = lambda dep: (readings.append(time.monotonic()), watch(dep))[1]  # type: ignore[method-assign]
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        sent = drive(svc.url, ingest, 120, seed=1, settled=True)
        wait_for(
            lambda: count(engine, deployments, deployments.c.action == "deploy") >= 1,
            120,
            "a gated canary deploy",
        )
        # keep traffic flowing until the trainer judges the canary
        for seed in range(2, 12):
            if count(engine, deployments, deployments.c.action.in_(("promote", "rollback"))):
                break
            sent += drive(svc.url, ingest, 40, seed=seed)
        wait_for(
            lambda: (
                count(engine, deployments, deployments.c.action.in_(("promote", "rollback"))) >= 1
            ),
            90,
            "a canary verdict",
        )
        # every rollout gets exactly one reward (sim horizon: 16 s)
        wait_for(lambda: count(engine, rewards) == count(engine, rollouts), 60, "all rewards")
    finally:
        stop.set()
        thread.join(timeout=60)
    assert count(engine, rewards, rewards.c.suggestion_id.in_(sent)) == len(sent)
    assert readings and all(b - a >= 0.59 for a, b in zip(readings, readings[1:], strict=False))
    with engine.connect() as conn:
        candidate = conn.execute(sa.select(policies).where(policies.c.version == 2)).one()
    assert candidate.parent == 1 and candidate.summary["gate"]["passed"] is True
    # the check weighed the kept characters per request too (its figures, as JSON holds them)
    gate = candidate.summary["gate"]
    assert gate["kept_live"] >= 0 and gate["kept_candidate_est"] >= 0 and gate["kept_se"] >= 0
    assert count(engine, rewards, rewards.c.trained_into == 2) == candidate.summary["rollouts"]
    status = httpx.get(
        svc.url + "/admin/training", headers={"Authorization": f"Bearer {ingest}"}
    ).json()
    assert status["rewards_finalized"] >= len(sent) and status["trainer"]["history"]
    # the people above a twelfth of the batch were weighted down to it; the state keeps who
    caps = candidate.summary["caps"]
    assert caps["max_share"] == 0.05 and caps["users_capped"] >= 1 and caps["keys_capped"] == 0
    batch_caps = status["trainer"]["capped"][0]
    assert batch_caps["rollouts"] == candidate.summary["rollouts"]
    assert len(batch_caps["users"]) == caps["users_capped"]
    # a batch of 60 rows may miss one of the 12 people: the cap is then 1/11 (never below 1/n)
    with engine.connect() as conn:
        people = conn.execute(
            sa.select(sa.func.count(sa.distinct(rollouts.c.user_id))).where(
                rollouts.c.suggestion_id.in_(
                    sa.select(rewards.c.suggestion_id).where(rewards.c.trained_into == 2)
                )
            )
        ).scalar_one()
    assert 2 <= people <= 12
    assert all(
        u["weight_share"] == pytest.approx(1 / people, abs=1e-3) and u["share"] > 1 / people
        for u in batch_caps["users"]
    )
    trust = httpx.get(
        svc.url + "/admin/metrics",
        params={"window": "1h"},
        headers={"Authorization": f"Bearer {ingest}"},
    ).json()["feedback"]
    assert trust["batches"] >= 1 and trust["capped_users"]
    # what the gate's fit replays: exactly the shown rollouts already trained on, newest first
    replay = trainer._replay_rows()
    with engine.connect() as conn:
        expected = (
            conn.execute(
                sa.select(rollouts.c.suggestion_id)
                .join(rewards, rewards.c.suggestion_id == rollouts.c.suggestion_id)
                .where(rollouts.c.shown.is_(True), rewards.c.trained_at.is_not(None))
            )
            .scalars()
            .all()
        )
    assert expected and sorted(r.suggestion_id for r in replay) == sorted(expected)
    assert "gate_fit/shown" in candidate.summary["update"]
    # the supervised term read the batch's settled texts, each for its own rollout
    assert candidate.summary["update"]["settled/examples"] == candidate.summary["rollouts"]
    settled_replay = trainer._settled_replay_rows()
    assert settled_replay and {r.suggestion_id for r in settled_replay} <= set(sent)
    with engine.connect() as conn:
        trained = set(
            conn.execute(
                sa.select(rewards.c.suggestion_id).where(rewards.c.trained_at.is_not(None))
            ).scalars()
        )
    assert {r.suggestion_id for r in settled_replay} <= trained
    engine.dispose()


@pytest.mark.integration  # the app on a socket, `tabloop train`
def test_kill_9_loses_no_reward_and_trains_nothing_twice(
    tmp_path: Path, pg_url: str, durable_kafka: Any
) -> None:
    """`tabloop train` SIGKILLed mid-stream, with a second member in its consumer group: the
    second one takes over its partitions and the lead (training) from what is durable, every
    rollout ends with exactly one reward, and each candidate's batch is the rewards stamped
    with its version."""
    from service.relay import Relay

    settings = make_settings(
        tmp_path,
        pg_url=pg_url,
        bootstrap=durable_kafka.bootstrap,
        profile="sim",
        policy_poll_interval_s=0.2,
        kafka_topic_partitions=3,
        rate_limit_per_s=10_000,
        rate_limit_burst=10_000,
    )
    upgrade(settings)
    engine = make_engine(settings)
    with engine.begin() as conn:
        bootstrap(conn, settings.base_checkpoint)
        ingest = create_key(conn, name="t", scopes=frozenset({"ingest", "admin"}))[1]
        deploy = create_key(conn, name="trainer", scopes=frozenset({"deploy"}))[1]
    svc = RunningService(settings).start()
    stop = threading.Event()
    relay = threading.Thread(
        target=Relay(settings, make_engine(settings)).run, args=(stop,), daemon=True
    )
    relay.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TABLOOP_")}
    env.update(
        TABLOOP_DATA_DIR=str(tmp_path / "trainer-data"),
        TABLOOP_DATABASE_URL=pg_url,
        TABLOOP_KAFKA_BOOTSTRAP_SERVERS=durable_kafka.bootstrap,
        TABLOOP_PROFILE="sim",
        TABLOOP_TRAINER_API_URL=svc.url,
        TABLOOP_TRAINER_API_KEY=deploy,
        TABLOOP_TRAINER_BATCH_SIZE="40",
        TABLOOP_KAFKA_SESSION_TIMEOUT_MS="3000",
    )
    train = [str(Path(sys.executable).parent / "tabloop"), "train"]
    proc = subprocess.Popen(train, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second: subprocess.Popen[bytes] | None = None
    try:
        sent = drive(svc.url, ingest, 100, seed=3)
        wait_for(lambda: count(engine, rewards) >= 10, 120, "the first rewards")
        # the first trainer leads now; a second one (another machine) joins the group
        second_log = tmp_path / "second.log"
        with second_log.open("wb") as err:
            second = subprocess.Popen(
                train,
                env={**env, "TABLOOP_DATA_DIR": str(tmp_path / "second-data")},
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
        wait_for(lambda: b"another trainer leads" in second_log.read_bytes(), 60, "a member")
        proc.send_signal(signal.SIGKILL)  # mid-stream: some rewards final, many pending
        proc.wait(timeout=30)
        killed_at = count(engine, rewards)
        sent += drive(svc.url, ingest, 60, seed=4)
        wait_for(lambda: count(engine, rewards) == len(sent), 120, "every rollout's reward")
        assert killed_at < len(sent)
        assert b"now leads" in second_log.read_bytes()
    finally:
        stop_process(proc)
        if second is not None:
            stop_process(second)
        stop.set()
        relay.join(timeout=30)
        svc.stop()
    with engine.connect() as conn:
        assert set(conn.execute(sa.select(rewards.c.suggestion_id)).scalars()) == set(sent)
        for p in conn.execute(sa.select(policies).where(policies.c.parent.is_not(None))).all():
            used = conn.execute(
                sa.select(sa.func.count())
                .select_from(rewards)
                .where(rewards.c.trained_into == p.version)
            ).scalar_one()
            assert used == p.summary["rollouts"]
    engine.dispose()


def test_a_new_reward_spec_is_followed_without_a_restart(tmp_path: Path) -> None:
    """PUT /admin/reward-spec while the trainer runs: the join's windows and the reward rows
    written afterwards use the new version; pending rollouts get the new due times."""
    from tabloop.core.reward import RolloutInfo
    from tabloop.core.reward_spec import RewardSpec
    from tabloop.core.reward_store import current_spec, put_spec
    from trainer.join import Join, Pending

    settings = make_settings(tmp_path, profile="sim")
    upgrade(settings)
    engine = make_engine(settings)
    version, spec = current_spec(engine, "sim")
    join = Join(engine, spec, version)
    created = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    shown = RolloutInfo("s1", "u1", created, shown=True, text_chars=5)
    due = created + dt.timedelta(seconds=spec.decision_window_s)
    join.pending["s1"] = Pending(shown, 1, due=due)
    trainer = Trainer(settings, engine, ServiceClient("http://127.0.0.1:9", "unused"))

    trainer._follow_spec(join)  # nothing new: unchanged
    assert join.spec_version == 1 and trainer.state.reward_spec_version is None

    longer = RewardSpec.from_dict({**spec.to_dict(), "decision_window_s": 9})
    with engine.begin() as conn:
        put_spec(conn, longer, None)
    trainer._follow_spec(join)
    assert (join.spec_version, join.spec) == (2, longer)
    assert trainer.state.reward_spec_version == 2
    assert join.pending["s1"].due == created + dt.timedelta(seconds=9)
    assert trainer.horizon == dt.timedelta(seconds=longer.horizon_s)
    engine.dispose()


@pytest.mark.parametrize(
    ("version", "root"),
    [
        pytest.param(1, 1, id="the-first-base"),
        pytest.param(4, 1, id="trained-from-the-first-base"),
        pytest.param(5, 5, id="a-base-registered-later"),
        pytest.param(7, 5, id="trained-from-the-later-base"),
        pytest.param(9, 9, id="unknown-version"),
        pytest.param(11, 10, id="a-cycle-ends-the-walk"),
    ],
)
def test_the_kl_reference_is_the_root_of_the_live_policys_own_lineage(
    version: int, root: int
) -> None:
    parents = {1: None, 2: 1, 3: 2, 4: 3, 5: None, 6: 5, 7: 6, 10: 11, 11: 10}
    assert lineage_root(parents, version) == root


def test_one_key_is_never_reported_capped(tmp_path: Path) -> None:
    """276 rows of one key, a person over the cap: the person is capped, the key is not (the
    float32 weights of the batch, summed, fell short of the rows by more than a millionth)."""
    from types import SimpleNamespace

    settings = make_settings(tmp_path)
    trainer = Trainer(
        settings,
        make_engine(settings),
        ServiceClient("http://127.0.0.1:9", "x"),
        TrainerConfig(max_share=0.05),
    )
    rng = random.Random(0)
    rows = [
        SimpleNamespace(user_id=f"u{rng.randrange(12)}" if rng.random() < 0.7 else "u0")
        for _ in range(276)
    ]
    for row in rows:
        row.api_key_id = "k"
    caps = trainer._record_caps(rows, dt.datetime.now(dt.UTC))  # type: ignore[arg-type]
    assert caps["users_capped"] >= 1 and caps["keys_capped"] == 0


def test_a_rank_killed_mid_update_registers_nothing_and_the_next_round_trains(
    embedded: Any,
) -> None:
    """A 2-rank data-parallel update whose second rank is SIGKILLed mid-update: no candidate
    is registered and no reward stamped; the next round starts new ranks, trains on the same
    rollouts and deploys."""
    from trainer.distributed import UpdatePool

    settings, svc, ingest, deploy = embedded
    cfg = TrainerConfig(
        batch_size=40,
        canary_fraction=0.5,
        deploy_check=PASSING_CHECK,
        poll_timeout_s=0.2,
        nproc=2,
    )
    engine = make_engine(settings)
    # hold_s: each rank waits 3 s after a job's doorbell, long enough to kill it mid-update
    pool = UpdatePool(2, hold_s=3.0)
    trainer = Trainer(settings, engine, ServiceClient(svc.url, deploy), cfg, pool=pool)
    stop = threading.Event()
    thread = threading.Thread(target=trainer.run, args=(stop,), daemon=True)
    thread.start()
    try:
        drive(svc.url, ingest, 60, seed=5)
        wait_for(lambda: trainer.state.state == "updating", 120, "the first update")
        victim = pool.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: any(h.event == "update_failed" for h in trainer.state.history),
            60,
            "the failed update",
        )
        assert count(engine, policies) == 1, "the failed update registered a candidate"
        assert count(engine, rewards, rewards.c.trained_at.is_not(None)) == 0
        wait_for(
            lambda: count(engine, deployments, deployments.c.action == "deploy") >= 1,
            180,
            "the next round's candidate deployed",
        )
        respawned = pool.worker_pids
    finally:
        stop.set()
        thread.join(timeout=60)
    events = [h.event for h in trainer.state.history]
    assert events.index("update_failed") < events.index("canary"), events
    assert respawned and victim not in respawned  # the next round's new rank
    with engine.connect() as conn:
        candidate = conn.execute(sa.select(policies).where(policies.c.version == 2)).one()
    assert count(engine, rewards, rewards.c.trained_into == 2) == candidate.summary["rollouts"]
    engine.dispose()

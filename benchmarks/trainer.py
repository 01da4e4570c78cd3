"""The trainer's speed: update throughput, reward-join latency, and freshness.

    python benchmarks/trainer.py [--minutes 6] [--batch 256]

1. Update throughput: rollouts/s through one policy-gradient update of the shipped base policy
   (d=192, 3 layers), on rollouts it sampled itself from held-out code, CPU, 1 thread.
2. A live run of `tabloop up` in the sim profile (reward windows in seconds), driven by editors
   that accept suggestions ending a statement and reject the rest, for --minutes. From its
   database: join latency (last feedback event received -> reward finalized, and rollout ->
   reward), and freshness: for each feedback event, the time until the first policy trained
   on it went live (promoted), median over events.
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._server import tabloop_up  # noqa: E402
from service.policy.checkpoint import load_checkpoint  # noqa: E402
from service.policy.sampling import complete  # noqa: E402
from trainer.corpus import sample_cursors  # noqa: E402
from trainer.update import Batch, UpdateConfig, update  # noqa: E402

BASE = Path(__file__).resolve().parent.parent / "service" / "policy" / "base"


def update_throughput(batch_size: int) -> None:
    torch.set_num_threads(1)
    model, tok, _ = load_checkpoint(BASE)
    ref, _, _ = load_checkpoint(BASE)
    g = torch.Generator().manual_seed(0)
    cursors = sample_cursors("heldout", batch_size, seed=0)
    actions = [complete(model, tok, c.prefix, "", 16, 0.7, 0.95, g) for c in cursors]
    rewards = [random.Random(i).choice([0.0, -0.25, 0.75]) for i in range(batch_size)]
    batch = Batch.of(actions, rewards)
    model.requires_grad_(True)
    cfg = UpdateConfig()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate)
    t0 = time.perf_counter()
    update(model, ref, tok, batch, opt, cfg)
    secs = time.perf_counter() - t0
    tokens = sum(len(a.token_ids) for a in actions) / batch_size
    ctx = sum(len(a.context_token_ids) for a in actions) / batch_size
    print(
        f"update: {batch_size} rollouts (mean {tokens:.1f} sampled + {ctx:.0f} context tokens) "
        f"in {secs:.2f} s = {batch_size / secs:.0f} rollouts/s (1 thread)"
    )


def drive(url: str, token: str, stop: threading.Event, users: int, seed: int) -> None:
    rng = random.Random(seed)
    cursors = sample_cursors("heldout", 2000, seed=seed)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        while not stop.is_set():
            evs = []
            for _ in range(8):
                cur = rng.choice(cursors)
                user = f"u{rng.randrange(users)}"
                r = c.post(
                    "/v1/complete",
                    json={"user_id": user, "prefix": cur.prefix[-2000:], "max_new_tokens": 16},
                ).json()
                if r["shown"]:
                    good = r["text"] and cur.rest_of_line.startswith(r["text"].rstrip("\n"))
                    evs.append(
                        {
                            "event_id": str(uuid.uuid4()),
                            "type": "accept" if good else "reject",
                            "user_id": user,
                            "suggestion_id": r["suggestion_id"],
                            "occurred_at": dt.datetime.now(dt.UTC)
                            .isoformat()
                            .replace("+00:00", "Z"),
                        }
                    )
            if evs:
                c.post("/v1/events", json={"events": evs})


def live_run(minutes: float, batch: int) -> None:
    env = {
        "TABLOOP_PROFILE": "sim",
        "TABLOOP_TRAINER_BATCH_SIZE": str(batch),
        "TABLOOP_TRAINER_CANARY_MIN_ROLLOUTS": str(max(20, batch // 4)),
    }
    with tabloop_up(**env) as srv:
        stop = threading.Event()
        t = threading.Thread(target=drive, args=(srv.url, srv.token, stop, 30, 0))
        t.start()
        time.sleep(minutes * 60)
        stop.set()
        t.join()
        time.sleep(20)  # let the last rewards finalize
        engine = sa.create_engine(f"sqlite:///{srv.data_dir / 'tabloop.db'}")
        with engine.connect() as conn:

            def q(sql: str) -> list:
                return list(conn.execute(sa.text(sql)).all())

            n_roll = q("SELECT count(*) FROM rollouts")[0][0]
            deps = q("SELECT action, count(*) FROM deployments GROUP BY action")
            join = q("""SELECT r.finalized_at, max(e.received_at) FROM rewards r JOIN events e
                        ON e.suggestion_id = r.suggestion_id GROUP BY r.suggestion_id""")
            roll = q("""SELECT r.finalized_at, o.created_at FROM rewards r JOIN rollouts o
                        ON o.suggestion_id = r.suggestion_id""")
            fresh = q("""SELECT e.received_at, min(d.created_at) FROM events e
                         JOIN rewards r ON r.suggestion_id = e.suggestion_id
                         JOIN deployments d ON d.live_version = r.trained_into
                           AND d.action IN ('promote', 'deploy')
                         WHERE r.trained_into IS NOT NULL GROUP BY e.event_id""")
        engine.dispose()

    def secs(pairs: list) -> list[float]:
        parse = dt.datetime.fromisoformat
        return [(parse(str(a)) - parse(str(b))).total_seconds() for a, b in pairs]

    print(f"live run: {minutes:g} min, {n_roll} rollouts, deployments {dict(deps)}")
    if join:
        j = secs(join)
        print(
            f"join latency (last event -> reward final): median {statistics.median(j):.1f} s, "
            f"p90 {sorted(j)[int(0.9 * len(j))]:.1f} s over {len(j)} rewards with feedback"
        )
    r = secs(roll)
    print(f"rollout -> reward final: median {statistics.median(r):.1f} s over {len(r)} rewards")
    if fresh:
        f = secs([(b, a) for a, b in fresh])
        print(
            f"freshness (feedback event -> first live policy trained on it): median "
            f"{statistics.median(f):.1f} s, p90 {sorted(f)[int(0.9 * len(f))]:.1f} s "
            f"over {len(f)} events"
        )
    else:
        print("freshness: no policy trained on this run's feedback went live")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--batch", type=int, default=160, help="trainer batch (sim profile)")
    ap.add_argument("--update-batch", type=int, default=256)
    args = ap.parse_args()
    update_throughput(args.update_batch)
    live_run(args.minutes, args.batch)


if __name__ == "__main__":
    main()

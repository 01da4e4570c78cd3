"""The trainer's speed: update throughput, reward-join latency, and freshness.

    python benchmarks/training.py [--minutes 6] [--batch 256] [--nproc N] [--update-only]
                                 [--device auto|cpu|cuda]

1. Update throughput: rollouts/s through one policy-gradient update of the shipped base policy
   (d=192, 3 layers), on rollouts it sampled itself from held-out code, CPU, 1 thread; with
   --nproc N also 1 process with N threads and N data-parallel gloo ranks of 1 thread each
   (trainer/distributed.py). With --device cuda: one update on the GPU in bf16 autocast (and
   with --nproc N, N NCCL ranks, one per GPU).
2. A live run of `tabloop up` in the sim profile (reward windows in seconds), driven by editors
   that accept suggestions ending a statement and reject the rest, for --minutes. From its
   database: join latency (last feedback event received -> reward finalized, and rollout ->
   reward), and freshness: for each feedback event, the time until the first policy trained
   on it went live (promoted), median over events.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import random
import statistics
import threading
import time
import uuid
from pathlib import Path

import httpx
import sqlalchemy as sa
import torch

from benchmarks._server import tabloop_up
from tabloop.core.corpus import sample_cursors
from tabloop.core.policy.checkpoint import load_checkpoint
from tabloop.core.policy.device import precision, resolve
from tabloop.core.policy.model import GPT
from tabloop.core.policy.sampling import complete
from tabloop.core.policy.tokenizer import CodeTokenizer
from trainer.distributed import UpdatePool
from trainer.update import Batch, UpdateConfig, UpdateInputs

BASE = Path(__file__).resolve().parent.parent / "tabloop" / "core" / "policy" / "base"


def update_throughput(batch_size: int, nproc: int = 1, device: str = "cpu") -> None:
    """With nproc > 1 also 1 rank with nproc threads and nproc gloo ranks of 1 thread each
    (trainer/distributed.py; the pool's start-up not counted, sending the job counted)."""
    torch.set_num_threads(1)
    place = resolve(device)
    model, tok, _ = load_checkpoint(BASE)
    ref, _, _ = load_checkpoint(BASE)
    model.to(place), ref.to(place)
    g = torch.Generator().manual_seed(0)
    cursors = sample_cursors("heldout", batch_size, seed=0)
    actions = [complete(model, tok, c.prefix, "", 16, 0.7, 0.95, g) for c in cursors]
    rewards = [random.Random(i).choice([0.0, -0.25, 0.75]) for i in range(batch_size)]
    batch = Batch.of(actions, rewards)
    model.requires_grad_(True)
    tokens = sum(len(a.token_ids) for a in actions) / batch_size
    ctx = sum(len(a.context_token_ids) for a in actions) / batch_size
    print(
        f"update: {batch_size} rollouts (mean {tokens:.1f} sampled + {ctx:.0f} context tokens) "
        f"on {place} ({precision(place)})"
    )
    runs = [(1, 1)] + ([(1, nproc), (nproc, 1)] if nproc > 1 else [])
    if place.type == "cuda":  # threads do not matter there
        runs = [(1, 1)] + ([(nproc, 1)] if nproc > 1 else [])
    for ranks, threads in runs:
        first, warm = _timed_updates(model, ref, tok, batch, ranks, threads, place.type)
        print(
            f"  {ranks} rank(s) x {threads} thread(s): {warm:.2f} s = {batch_size / warm:.0f} "
            f"rollouts/s (first update {first:.2f} s = {batch_size / first:.0f} rollouts/s)"
        )
    torch.set_num_threads(1)


def _timed_updates(
    model: GPT,
    ref: GPT,
    tok: CodeTokenizer,
    batch: Batch,
    ranks: int,
    threads: int,
    device: str = "cpu",
) -> tuple[float, float]:
    """Seconds of two updates of fresh copies of `model` with `ranks` ranks of `threads`
    threads each (the same shuffles): the first, and the second (workers warm)."""
    torch.set_num_threads(threads)
    cfg = UpdateConfig()
    secs = []
    with UpdatePool(ranks, threads_per_rank=threads, device=device) as pool:
        for _ in range(2):
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=cfg.learning_rate)
            torch.manual_seed(0)
            t0 = time.perf_counter()
            pool.update(UpdateInputs(m, ref, tok, batch, opt, cfg))
            if device == "cuda":
                torch.cuda.synchronize()
            secs.append(time.perf_counter() - t0)
    return secs[0], secs[1]


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
    ap.add_argument(
        "--nproc", type=int, default=1, help="also time the update on this many gloo ranks"
    )
    ap.add_argument("--update-only", action="store_true", help="skip the live run")
    ap.add_argument("--device", default="cpu", help="where the update runs (TABLOOP_DEVICE)")
    args = ap.parse_args()
    update_throughput(args.update_batch, args.nproc, args.device)
    if not args.update_only:
        live_run(args.minutes, args.batch)


if __name__ == "__main__":
    main()

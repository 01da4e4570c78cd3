"""Completion latency and throughput on held-out code, and latency around hot swaps.

    python benchmarks/complete.py [--seconds 20] [--concurrency 1 8 32] [--batch-max 1 32]
                                  [--device auto|cpu|cuda] [--model DIR]

Starts `tabloop up` (embedded, the shipped base policy, or with `--model` a Hugging Face
model directory as the base: TABLOOP_BASE_MODEL) on a loopback port, once per
`--batch-max` (TABLOOP_INFERENCE_BATCH_MAX: 1 samples one request at a time, more batches
concurrent requests), sends prompts cut from the held-out split of the corpus (never trained
on), and prints p50/p99 latency (client side, HTTP included; and the model time the server
reports) and requests/s per concurrency. Then, on the last server, under load at concurrency 1,
registers a second version and deploys it as a canary, promotes it and rolls it back, and
compares latency within 2 s after each swap with the rest.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import httpx

from benchmarks._server import Server, tabloop_up
from tabloop.core.corpus import sample_cursors


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))] if xs else float("nan")


def prompts(n: int) -> list[dict]:
    out = []
    for i, c in enumerate(sample_cursors("heldout", n, seed=0)):
        # the text after the cursor, less the rest of its line (what the person is about to type)
        after = c.suffix[len(c.rest_of_line) :]
        out.append(
            {
                "user_id": f"bench-{i % 50}",
                "prefix": c.prefix[-4096:],
                "suffix": after[:1024],
                "language": "python",
                "max_new_tokens": 32,
            }
        )
    return out


def load(
    url: str,
    token: str,
    bodies: list[dict],
    concurrency: int,
    seconds: float,
    max_requests: int = 100_000,
) -> tuple[list[tuple[float, float, float]], int]:
    """Closed-loop load; returns [(t_sent, client_ms, server_ms)] and the error count."""
    results: list[tuple[float, float, float]] = []
    errors = 0
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    counter = iter(range(max_requests))

    def worker() -> None:
        nonlocal errors
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30
        ) as c:
            for i in counter:
                if time.monotonic() > deadline:
                    return
                t0 = time.monotonic()
                r = c.post("/v1/complete", json=bodies[i % len(bodies)])
                ms = (time.monotonic() - t0) * 1000
                with lock:
                    if r.status_code == 200:
                        results.append((t0, ms, r.json()["latency_ms"]))
                    else:
                        errors += 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="per concurrency level")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument(
        "--batch-max",
        type=int,
        nargs="+",
        default=[1, 32],
        help="TABLOOP_INFERENCE_BATCH_MAX of each server (1: unbatched)",
    )
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--device", default="cpu", help="TABLOOP_DEVICE of the servers")
    ap.add_argument(
        "--model",
        help="a Hugging Face model directory to serve instead of the shipped base "
        "(TABLOOP_BASE_MODEL; docs/MODEL.md, Bring your model)",
    )
    args = ap.parse_args()
    base = {"TABLOOP_BASE_MODEL": args.model} if args.model else {}
    bodies = prompts(args.prompts)
    print(f"{len(bodies)} held-out prompts, max_new_tokens 32")
    print(
        f"{'batch max':>9} {'concurrency':>11} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'model p50':>9} {'model p99':>9} {'errors':>6}"
    )
    for i, batch_max in enumerate(args.batch_max):
        with tabloop_up(
            TABLOOP_INFERENCE_BATCH_MAX=str(batch_max), TABLOOP_DEVICE=args.device, **base
        ) as srv:
            load(srv.url, srv.token, bodies, 1, 3.0)  # warm-up
            for conc in args.concurrency:
                t0 = time.monotonic()
                res, errs = load(srv.url, srv.token, bodies, conc, args.seconds)
                rate = len(res) / (time.monotonic() - t0)
                client = [r[1] for r in res]
                model = [r[2] for r in res]
                print(
                    f"{batch_max:>9} {conc:>11} {rate:>7.1f} {pct(client, 50):>7.1f} "
                    f"{pct(client, 99):>7.1f} {pct(model, 50):>9.1f} {pct(model, 99):>9.1f} "
                    f"{errs:>6}",
                    flush=True,
                )
            if i == len(args.batch_max) - 1:
                hot_swaps(srv, bodies)


def hot_swaps(srv: Server, bodies: list[dict]) -> None:
    # Hot swaps under load: register v2 (same weights), canary, promote, roll back.
    base = srv.data_dir / "policies" / "v1"
    files = {
        k: (n, (base / n).read_bytes())
        for k, n in (
            ("manifest", "manifest.json"),
            ("weights", "model.safetensors"),
            ("tokenizer", "tokenizer.json"),
        )
    }
    admin = httpx.Client(
        base_url=srv.url, headers={"Authorization": f"Bearer {srv.token}"}, timeout=60
    )
    assert admin.post("/admin/policies", files=files, data={"parent": "1"}).status_code == 201
    swaps: list[float] = []

    def operator() -> None:
        for step in ("deploy", "promote", "rollback"):
            time.sleep(4.0)
            swaps.append(time.monotonic())
            if step == "deploy":
                admin.post("/admin/policies/2/deploy", json={"canary_fraction": 0.5})
            elif step == "promote":
                admin.post("/admin/policies/2/promote")
            else:
                admin.post("/admin/rollback")

    op = threading.Thread(target=operator)
    op.start()
    res, errs = load(srv.url, srv.token, bodies, 1, 16.0)
    op.join()
    near = [ms for t, ms, _ in res if any(0 <= t - s <= 2.0 for s in swaps)]
    far = [ms for t, ms, _ in res if not any(0 <= t - s <= 2.0 for s in swaps)]
    print(
        f"hot swap (3 swaps, concurrency 1): {len(res)} requests, {errs} errors; "
        f"p99 within 2 s after a swap {pct(near, 99):.1f} ms vs {pct(far, 99):.1f} ms "
        f"otherwise (p50 {statistics.median(near) if near else float('nan'):.1f} vs "
        f"{statistics.median(far) if far else float('nan'):.1f})"
    )


if __name__ == "__main__":
    main()

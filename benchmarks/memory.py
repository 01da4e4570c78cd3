"""What a workspace memory costs: build time, RAM, and the time a copy proposal adds to a request.

    python -m benchmarks.memory [--lines 100000] [--lookups 2000] [--seed 0]

The workspace is the standard library's training files, read in path order until `--lines`
lines, as `--people` people's documents (service/workspace/memory.build's layout). Figures:
- build: seconds to index it (tabloop.core.recall.Text: the suffix array of its reversed bytes)
  and the RAM the index holds (its arrays and texts) and the process's RSS growth;
- lookup: `propose()` at `--lookups` cursors of held-out files (prefix = the file above and the
  line up to a random column, no suffix), the file itself searched by `str.find` and the
  memory by the index: p50, p99 and max, one thread; with the proposal rate.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from collections.abc import Sequence

from tabloop.core.corpus import corpus_files, cursors_from, read_text
from tabloop.core.recall import SEPARATOR, Text, propose


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lines", type=int, default=100_000)
    ap.add_argument("--people", type=int, default=8)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    docs: list[bytes] = []
    lines = 0
    for path in sorted(corpus_files("train")):
        text = read_text(path)
        docs.append(text.encode("utf-8"))
        lines += text.count("\n") + 1
        if lines >= args.lines:
            break
    starts, at = [], 0
    for d in docs:
        starts.append(at)
        at += len(d) + len(SEPARATOR)
    owners = [i % args.people for i in range(len(docs))]
    before = rss_mb()
    t0 = time.perf_counter()
    memory = Text(SEPARATOR.join(docs), starts, owners)
    build_s = time.perf_counter() - t0
    held = len(memory.data) + len(memory.reversed) + memory.suffixes.nbytes
    print(
        f"workspace: {lines:,} lines, {len(docs)} documents, {len(memory):,} bytes, "
        f"{args.people} people"
    )
    print(
        f"build: {build_s:.2f} s; index holds {held / 1e6:.1f} MB "
        f"({held / len(memory):.1f} bytes per byte of code); peak RSS +{rss_mb() - before:.0f} MB"
    )

    cursors = cursors_from(sorted(corpus_files("heldout")), args.lookups, args.seed)
    random.Random(args.seed).shuffle(cursors)
    times, proposed = [], 0
    for cur in cursors:
        t0 = time.perf_counter()
        p = propose(cur.prefix, (), memory)
        times.append((time.perf_counter() - t0) * 1000)
        proposed += p is not None
    times.sort()
    print(
        f"lookup (propose: the file above + the memory), {len(times)} cursors: "
        f"p50 {statistics.median(times):.3f} ms, p99 {times[int(0.99 * len(times))]:.3f} ms, "
        f"max {times[-1]:.3f} ms; a proposal at {proposed / len(times):.0%} of them"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""simulator.output: what a report keeps of the command line."""

from __future__ import annotations

from simulator.output import redacted


def test_report_argv_keeps_no_api_key() -> None:
    argv = [
        "--api",
        "http://h",
        "--key",
        "tlk_a_secret",
        "--users",
        "16",
        "--admin-key=tlk_b_secret",
        "--seed",
        "0",
    ]
    kept = redacted(argv)
    assert kept == [
        "--api",
        "http://h",
        "--key",
        "<redacted>",
        "--users",
        "16",
        "--admin-key=<redacted>",
        "--seed",
        "0",
    ]
    assert not any("secret" in a for a in kept)
    assert argv[3] == "tlk_a_secret", "the caller's list is left alone"

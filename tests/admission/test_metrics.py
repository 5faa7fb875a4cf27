"""We test the admission metrics:
- a run of reviews gives the /metrics lines worked out from the calls (by outcome, kind and mode; memory asks by
  card size; the latency histogram's buckets and count), and a second run adds to them;
- in multiprocess mode (as `gpushard serve` runs with several workers): two worker processes that exit without
  a scrape leave their counts, summed, in another process's scrape; a worker that keeps running shows there at
  once, before it exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import prometheus_client

from webhook.admission import metrics as metrics_mod

# (outcome, kind, mode, seconds, memory ask or None): bucket edges, below the first, past the last.
CALLS = [
    ("patched", "Pod", "enforce", 0.0003, (23034, 4096)),
    ("patched", "Pod", "enforce", 0.0005, None),
    ("allowed", "Pod", "audit", 0.0011, None),
    ("denied", "Deployment", "enforce", 0.0123456789, None),
    ("patched", "Pod", "enforce", 10.0, (81559, 61440)),
    ("invalid", "unknown", "enforce", 42.5, None),
    ("patched", "Pod", "enforce", 1e-7, (23034, 8192)),
    ("error", "other", "audit", 0.3, None),
]


def _feed(m: metrics_mod.Metrics, calls=CALLS) -> None:
    for outcome, kind, mode, seconds, memory in calls:
        m.admitted(outcome, kind, mode)
        if memory:
            m.memory_ask(*memory)
        m.observe(mode, seconds)


def _expected_lines(calls=CALLS, times: int = 1) -> set[str]:
    """What the exposition says of ``calls`` counted ``times`` times, worked out here from the calls."""
    lines = set()
    for outcome, kind, mode in {(o, k, m) for o, k, m, _s, _mem in calls}:
        n = times * sum(1 for o, k, m, _s, _mem in calls if (o, k, m) == (outcome, kind, mode))
        lines.add(f'gpushard_admissions_total{{kind="{kind}",mode="{mode}",outcome="{outcome}"}} {float(n)}')
    for card in {mem[0] for *_rest, mem in calls if mem}:
        asked = [mem[1] for *_rest, mem in calls if mem and mem[0] == card]
        lines.add(f'gpushard_memory_ask_pods_total{{card_mib="{card}"}} {float(times * len(asked))}')
        lines.add(f'gpushard_memory_asked_mebibytes_total{{card_mib="{card}"}} {float(times * sum(asked))}')
    for mode in {m for _o, _k, m, _s, _mem in calls}:
        seconds = [sec for _o, _k, m, sec, _mem in calls if m == mode]
        lines.add(f'gpushard_admission_seconds_count{{mode="{mode}"}} {float(times * len(seconds))}')
        for bound in metrics_mod.LATENCY_BUCKETS:
            within = times * sum(1 for sec in seconds if sec <= bound)
            lines.add(f'gpushard_admission_seconds_bucket{{le="{bound}",mode="{mode}"}} {float(within)}')
    return lines


def _lines(text: bytes) -> set[str]:
    return set(text.decode().splitlines())


def test_the_text_counts_each_review_by_outcome_kind_mode_and_latency():
    m = metrics_mod.Metrics()
    _feed(m)
    text, content_type = m.exposition()
    assert content_type == prometheus_client.CONTENT_TYPE_LATEST
    assert _expected_lines() <= _lines(text)
    _feed(m)
    assert _expected_lines(times=2) <= _lines(m.exposition()[0])


# The multiprocess mode is chosen when prometheus_client is imported: each process is a fresh interpreter.
_WORKER = textwrap.dedent("""
    import sys, time
    from tests.admission import test_metrics as t
    from webhook.admission import metrics
    how, part = sys.argv[1], int(sys.argv[2])
    calls = t.CALLS[part::2]
    if how == "exit":
        t._feed(metrics.Metrics(), calls)  # never scraped
    elif how == "stay":
        m = metrics.Metrics()
        t._feed(m, calls)
        print("counted", flush=True)
        sys.stdin.read()  # until the test is done
    elif how == "scrape":
        sys.stdout.write(metrics.Metrics().exposition()[0].decode())
""")


def _run(folder, how: str, part: str, script: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(folder))
    args = ["-c", script, how, part, _WORKER] if script else ["-c", _WORKER, how, part]
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, check=True, timeout=60)


def _scrape(folder) -> list[str]:
    return _run(folder, "scrape", "0").stdout.splitlines()


def test_the_workers_counts_add_up_in_any_workers_scrape(tmp_path):
    for part in ("0", "1"):
        _run(tmp_path, "exit", part)
    assert {line for line in _expected_lines()} <= set(_scrape(tmp_path))


def test_a_running_worker_shows_in_another_workers_scrape_at_once(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, "stay", "0"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "counted\n"
        assert _expected_lines(CALLS[0::2]) <= set(_scrape(tmp_path))
        assert worker.poll() is None  # written while it runs, not at its exit
    finally:
        worker.stdin.close()
        worker.wait(30)

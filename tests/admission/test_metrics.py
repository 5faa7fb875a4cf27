"""We test the admission metrics counted in process and published to prometheus_client:
- a run of reviews gives the /metrics text that prometheus_client's own counters and histogram give
  for the same calls, line for line (the latency sum bit for bit), in one process;
- eight threads counting at once, while another flushes, lose no review;
- in multiprocess mode (as `gpushard serve` runs): two worker processes that exit without a scrape
  leave exactly the text plain prometheus_client files give; a worker that keeps running shows in
  another process's scrape within its flush interval; a worker whose pid was used before goes on
  from that worker's latency sum.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

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


def _write_directly(m: metrics_mod.Metrics, calls=CALLS) -> None:
    """Each call written to the prometheus_client metrics themselves, as the reference."""
    for outcome, kind, mode, seconds, memory in calls:
        m.admissions.labels(outcome, kind, mode).inc()
        if memory:
            m.memory_pods.labels(str(memory[0])).inc()
            m.memory_asked.labels(str(memory[0])).inc(memory[1])
        m.latency.labels(mode).observe(seconds)


def _reference(calls=CALLS) -> bytes:
    """The text prometheus_client gives when each call writes its metrics directly."""
    m = metrics_mod.Metrics()
    _write_directly(m, calls)
    return prometheus_client.generate_latest(m.registry)


def _without_created(text: bytes) -> list[str]:
    # _created is the time each series was made: it differs between any two registries.
    return [line for line in text.decode().splitlines() if "_created" not in line]


def test_the_text_is_what_prometheus_client_writes_for_the_same_reviews():
    m = metrics_mod.Metrics()
    _feed(m)
    text, content_type = m.exposition()
    assert content_type == prometheus_client.CONTENT_TYPE_LATEST
    assert _without_created(text) == _without_created(_reference())
    assert 'gpushard_admission_seconds_sum{mode="enforce"} ' in text.decode()
    # Counted again after a scrape: only the new reviews are added.
    _feed(m)
    assert _without_created(m.exposition()[0]) == _without_created(_reference(CALLS * 2))


def test_the_latency_sum_is_added_in_review_order():
    # 0.1 + 0.2 + 0.3 is not 0.1 + (0.2 + 0.3) in floats: the sum must be the sequential one.
    calls = [("allowed", "Pod", "enforce", s, None) for s in (0.1, 0.2, 0.3, 1e-17, 0.7)]
    m = metrics_mod.Metrics()
    _feed(m, calls[:1])
    m.flush()
    _feed(m, calls[1:])
    assert _without_created(m.exposition()[0]) == _without_created(_reference(calls))


def test_no_review_is_lost_to_threads():
    m = metrics_mod.Metrics()
    threads, per_thread = 8, 5000
    done = threading.Event()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows

    def count():
        for _ in range(per_thread):
            m.admitted("patched", "Pod", "enforce")
            m.observe("enforce", 0.25)  # exact in binary: the sum does not depend on the order

    def flush():
        while not done.is_set():
            m.flush()

    flusher = threading.Thread(target=flush)
    workers = [threading.Thread(target=count) for _ in range(threads)]
    try:
        flusher.start()
        for t in workers:
            t.start()
        for t in workers:
            t.join()
    finally:
        done.set()
        flusher.join()
        sys.setswitchinterval(old)
    text = m.exposition()[0].decode()
    n = threads * per_thread
    assert f'gpushard_admissions_total{{kind="Pod",mode="enforce",outcome="patched"}} {float(n)}' in text
    assert f'gpushard_admission_seconds_count{{mode="enforce"}} {float(n)}' in text
    assert f'gpushard_admission_seconds_bucket{{le="0.25",mode="enforce"}} {float(n)}' in text
    assert f'gpushard_admission_seconds_sum{{mode="enforce"}} {n * 0.25}' in text


# The multiprocess mode is chosen when prometheus_client is imported: each process is a fresh interpreter.
_WORKER = textwrap.dedent("""
    import sys, time
    from tests.admission import test_metrics as t
    from webhook.admission import metrics
    how, part = sys.argv[1], int(sys.argv[2])
    calls = t.CALLS[part::2]
    if how == "reference":
        t._write_directly(metrics.Metrics(), calls)
    elif how == "exit":
        t._feed(metrics.Metrics(), calls)  # never scraped nor flushed: the exit publishes
    elif how == "stay":
        m = metrics.Metrics(flush_interval=0.05)
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
    # Sorted: MultiProcessCollector reads the files in the folder's order, which follows their pids.
    return sorted(_without_created(_run(folder, "scrape", "0").stdout.encode()))


def test_workers_that_exit_leave_what_prometheus_client_files_hold(tmp_path):
    ours, reference = tmp_path / "ours", tmp_path / "reference"
    ours.mkdir()
    reference.mkdir()
    for part in ("0", "1"):
        _run(ours, "exit", part)
        _run(reference, "reference", part)
    text = _scrape(ours)
    assert text == _scrape(reference)
    assert 'gpushard_admissions_total{kind="Pod",mode="enforce",outcome="patched"} 4.0' in text
    assert 'gpushard_memory_asked_mebibytes_total{card_mib="23034"} 12288.0' in text


def test_a_running_worker_shows_in_another_workers_scrape(tmp_path):
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(tmp_path))
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, "stay", "0"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline() == "counted\n"
        want = 'gpushard_admission_seconds_count{mode="enforce"} 3.0'
        deadline = time.monotonic() + 30  # a bound for a loaded machine, not a measure of the interval
        while want not in _scrape(tmp_path):
            assert time.monotonic() < deadline, "the running worker's counts never reached the files"
            time.sleep(0.05)
        assert worker.poll() is None  # published while it runs, not at its exit
    finally:
        worker.stdin.close()
        worker.wait(30)


def test_a_reused_pid_goes_on_from_the_old_workers_sum(tmp_path):
    # Both "workers" write the file of one fixed process identity, as two workers with the same pid
    # would (prometheus_client's documented process_identifier), here and in the reference.
    script = textwrap.dedent("""
        import sys
        from prometheus_client import values
        values.ValueClass = values.MultiProcessValue(lambda: 4242)
        exec(sys.argv[3])
    """)
    for folder in ("ours", "reference"):
        (tmp_path / folder).mkdir()
        for part in ("0", "1"):
            _run(tmp_path / folder, "exit" if folder == "ours" else "reference", part, script=script)
    assert sorted(f.name for f in (tmp_path / "ours").iterdir()) == ["counter_4242.db", "histogram_4242.db"]
    assert _scrape(tmp_path / "ours") == _scrape(tmp_path / "reference")

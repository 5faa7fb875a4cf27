"""Slow-client benchmark: reviews answered while other clients stall on the webhook's port.

The real `gpushard serve` (gunicorn, TLS, the shipped 8 threads, the example cluster file) answers dry-run
reviews sent one after another, each on a new TLS connection with the API server's 5 s timeout, for a few
seconds in each of three rounds measured in the same run:
- the baseline: nobody else on the port;
- 32 clients that open a connection, send the first 6 bytes of a TLS handshake and wait, and open another
  as soon as the webhook closes theirs;
- 32 clients that finish the handshake, send a request's headers and one byte of its body, and wait, likewise.
It prints, per round, the reviews answered and failed, p50 and p99, and the answered rate as a ratio of the
baseline's.

Run: python bench/slowclients.py [--seconds S] [--clients N]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import stalling  # noqa: E402
from tests.admission import objects  # noqa: E402


def _round(server, ca: Path, seconds: float, clients: int, mode: str | None) -> dict:
    ended = stalling.attack(server.port, objects.client_context(ca), clients if mode else 0, objects.SERVICE_HOST,
                            mid_request=mode == "request")
    time.sleep(0.5 if mode else 0)  # the stalled connections open first; a round's figures come after
    body = json.dumps(objects.review(objects.pod(objects.container("t")), uid="u", dry_run=True)).encode()
    answered, failed, latencies = 0, 0, []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        try:
            status, _, _ = server.request("POST", "/mutate", body, timeout=5)
        except OSError:
            status = 0
        if status == 200:
            answered += 1
            latencies.append(time.monotonic() - started)
        else:
            failed += 1
    ended()
    latencies.sort()
    pick = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000) if latencies else None
    return {"answered": answered, "failed": failed, "p50": pick and pick(0.5), "p99": pick and pick(0.99)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpushard-slow-") as tmp:
        certs = Path(tmp) / "certs"
        subprocess.run([sys.executable, "-m", "webhook.cli", "certs", "--out", str(certs)], check=True,
                       capture_output=True, cwd=ROOT)
        server = objects.Server(certs, ROOT / "examples" / "cluster.yaml", threads=8).start()
        try:
            _round(server, certs / "ca.crt", 1.0, 0, None)  # warm-up, not reported
            rounds = [("nobody else", None), (f"{args.clients} stalled mid-handshake", "handshake"),
                      (f"{args.clients} stalled mid-request", "request")]
            results = [(name, _round(server, certs / "ca.crt", args.seconds, args.clients, mode))
                       for name, mode in rounds]
        finally:
            server.stop()
    base = results[0][1]["answered"] or 1
    print(f"reviews sent one after another for {args.seconds:g} s per round, 8 threads, 5 s client timeout")
    print(f"{'round':<32} {'answered':>8} {'failed':>6} {'p50 ms':>8} {'p99 ms':>8} {'vs baseline':>11}")
    for name, r in results:
        p50 = f"{r['p50']:.1f}" if r["p50"] is not None else "-"
        p99 = f"{r['p99']:.1f}" if r["p99"] is not None else "-"
        print(f"{name:<32} {r['answered']:>8} {r['failed']:>6} {p50:>8} {p99:>8} {r['answered'] / base:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

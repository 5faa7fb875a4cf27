"""The webhook Deployment runs one chooser per replica, with memory for a large cluster's view.

We test:
- the webhook container asks for one gunicorn worker (or none, serve's default of one): several
  workers would each keep their own view and memory of choices;
- its memory limit covers the view's measured peak at 50,000 pods (bench/view.py) with headroom.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from webhook import cli

ROOT = Path(__file__).resolve().parents[2]
# bench/view.py at 2,000 nodes x 50,000 pods: worker peak 178 MiB, gunicorn master 29 MiB.
MEASURED_PEAK_MIB = 178 + 29


def _container() -> dict:
    docs = yaml.safe_load_all((ROOT / "deploy/base/webhook.yaml").read_text())
    deployment = next(d for d in docs if d and d.get("kind") == "Deployment")
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "webhook")


def _mib(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / (1024 * 1024)


def test_one_worker_per_replica():
    args = _container()["args"]
    workers = [a.split("=", 1)[1] for a in args if a.startswith("--workers=")]
    default = cli.build_parser().parse_args(["serve", "--cert", "c", "--key", "k"]).workers
    assert (workers or [str(default)]) == ["1"]


def test_memory_limit_covers_the_measured_view_with_headroom():
    limit = _mib(_container()["resources"]["limits"]["memory"])
    assert limit >= 1.5 * MEASURED_PEAK_MIB

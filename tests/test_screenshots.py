"""We test docs/screenshots.py, which draws the dashboard's queries over a test run for docs/metrics.md:
- its PromQL subset: selectors with = and =~, sum/min/max by labels, vector/vector and vector/number
  arithmetic on matching label sets, comparisons that filter, rate() and increase() over the scrapes
  before (counter resets too), histogram_quantile(), and an error for what it cannot read;
- over the simulated hour (agent collector, stand-in PodResources, fake /proc, local API server, the
  webhook's live view), every query of every dashboard panel has data at some minute, and the run
  shows what the docs say: a container above its share, a pod whose processes exit, a restart, a
  kubelet whose PodResources is away for three minutes (no shares series then, not 0).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def shots():
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs/screenshots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_promql_subset(shots):
    samples = shots.parse_samples(
        'm{a="x",b="1"} 4\nm{a="y",b="1"} 6\nm{a="y",b="2"} 2\nn{a="x",b="1"} 2\nn{a="y",b="1"} 3\n')

    def run(expr):
        return {tuple(sorted((k, v) for k, v in key if k != "__name__")): value
                for key, value in shots.Query(expr).evaluate(samples).items()}

    assert run('m{a="y"}') == {(("a", "y"), ("b", "1")): 6, (("a", "y"), ("b", "2")): 2}
    assert run('sum by (b) (m{a=~"x|y"})') == {(("b", "1"),): 10, (("b", "2"),): 2}
    assert run("max(m)") == {(): 6}
    assert run("m / n") == {(("a", "x"), ("b", "1")): 2, (("a", "y"), ("b", "1")): 2}
    assert run("m > 3") == {(("a", "x"), ("b", "1")): 4, (("a", "y"), ("b", "1")): 6}
    assert shots.Query("min(m) / 2").evaluate(samples) == {frozenset(): 1}
    # rate() and increase() over the scrapes before (a minute apart), with a counter reset; histogram_quantile.
    history = [shots.parse_samples(f'c_total{{a="x"}} {v}\nh_bucket{{le="0.1"}} {v}\nh_bucket{{le="1"}} {2 * v}\n'
                                   f'h_bucket{{le="+Inf"}} {2 * v}\n') for v in (0, 60, 120, 180, 240, 300, 360)]
    assert shots.Query("rate(c_total[5m])").evaluate(history[-1], history) == {frozenset({("a", "x")}): 1.0}
    assert shots.Query("increase(c_total[2m])").evaluate(history[2], history[:3]) == {frozenset({("a", "x")}): 120}
    assert shots.Query("rate(c_total[5m])").evaluate(history[0]) == {}  # no scrape before: no data
    reset = [history[3], shots.parse_samples('c_total{a="x"} 30\n')]
    assert shots.Query("rate(c_total[1m])").evaluate(reset[-1], reset) == {frozenset({("a", "x")}): 0.5}
    quantile = "histogram_quantile({q}, sum by (le) (rate(h_bucket[5m])))"
    assert shots.Query(quantile.format(q=0.99)).evaluate(history[-1], history) == {frozenset(): pytest.approx(0.982)}
    assert shots.Query(quantile.format(q=0.5)).evaluate(history[-1], history) == {frozenset(): pytest.approx(0.1)}
    for unreadable in ("rate(m)", "rate(sum(m)[5m])", "delta(m[5m])", "m[5m]"):
        with pytest.raises(ValueError):
            shots.Query(unreadable)


def test_every_panel_has_data_over_the_simulated_hour(shots, tmp_path):
    scrapes = shots.simulate(minutes=60, workdir=str(tmp_path))
    dashboard = json.loads(shots.DASHBOARD.read_text())
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        for target in panel["targets"]:
            query = shots.Query(shots.expand(target["expr"]))
            assert any(query.evaluate(s, scrapes[:i + 1]) for i, s in enumerate(scrapes)), \
                f"{panel['title']}: {target['expr']} has no data"

    def one(samples, name, **labels):
        hits = [v for k, v in samples.items() if dict(k)["__name__"] == name and set(labels.items()) <= k]
        return hits[0] if len(hits) == 1 else None

    first, last = scrapes[0], scrapes[-1]
    assert one(first, "gpushard_container_over_share", pod="train") == 0
    assert one(last, "gpushard_container_over_share", pod="train") == 1
    assert one(scrapes[30], "gpushard_container_gpu_processes", pod="notebook") == 0
    assert one(scrapes[30], "gpushard_container_shares", pod="notebook") == 30
    assert one(scrapes[41], "gpushard_container_gpu_processes", pod="batch") == 1  # restarted, still counted
    assert one(last, "gpushard_card_healthy", gpu="1") == 0
    assert one(last, "gpushard_view_free_shares", node="gpu-node-1", gpu="1") == 10
    # The kubelet's PodResources away for three minutes: the shares held are unknown, not 0.
    assert one(scrapes[53], "gpushard_agent_podresources_up") == 0
    assert one(scrapes[53], "gpushard_card_shares_allocated", gpu="0") is None
    assert one(scrapes[51], "gpushard_card_shares_allocated", gpu="0") == 75

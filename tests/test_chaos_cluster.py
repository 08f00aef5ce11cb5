"""A short cluster chaos (the core of scripts/chaos_cluster.py, a subset of its families): three
gateway processes on a real redis-server, N = 4 on each fake node, sync / sse / async traffic
with webhooks. One gateway is cut off from Redis while the others still reach it (and the cut
healed), then one is frozen past the TTL on a node that can tell nothing and woken.

After each: no node ran more than N, every request is accounted for (a cut only with its
gateway; an sse job cut with it resumed elsewhere and ended), every async job ended with its
webhook once, and once the traffic stopped nothing stayed counted in Redis.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import chaos_cluster as cc


async def test_cluster_chaos_smoke(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    knobs = cc.Knobs(hold=2.0, warm=1.0, after=1.0, workers=6, timed=False)
    report = await cc.run_families(tmp_path, knobs, ["partial_partition", "gateway_frozen_generic"],
                                   with_burst=False, seed=3)
    cc.print_report(report)
    assert [r.name for r in report.results] == ["partial_partition", "gateway_frozen_generic"]
    for r in report.results:
        assert not r.violations, "\n".join(r.violations[:10])
        assert r.ok, f"{r.name}: {'; '.join(r.problems)}"
        assert r.requests > 20, f"{r.name}: too little traffic to mean anything"
        assert max(r.max_concurrent.values()) == cc.N, r.max_concurrent  # the node was full, never more
    assert report.results[0].figures["webhooks"] > 0

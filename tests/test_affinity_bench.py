"""scripts/bench_affinity.py in its CI form: the same legs and workloads against the simulated GPU
with its prompt cache (the real-server run is the script, docs/BENCHMARKS.md). Checks that every
leg ran to the end, that no node ever ran more than its slots, and that the servers' own cache
reports reached the numbers. How much affinity wins is the benchmark's to say, not this test's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_affinity.py"
REQUESTS = 9


def test_bench_affinity_fake_runs_every_leg_within_the_slots(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--fake", "--requests", str(REQUESTS),
                           "--workloads", "docs,sessions", "--prefill-ms-per-1k", "60", "--step-ms", "2",
                           "--think-ms", "20", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "fake" and set(result["workloads"]) == {"docs", "sessions"}
    for name, workload in result["workloads"].items():
        legs = workload["legs"]
        assert list(legs) == ["rr", "least", "prefix"], (name, list(legs))
        for leg, r in legs.items():
            assert (r["requests"], r["ok"]) == (REQUESTS, REQUESTS), (name, leg, r)
            assert len(r["peak_in_flight"]) == 3 and max(r["peak_in_flight"]) <= 2, (name, leg, r)
            assert sum(r["per_node"].values()) == REQUESTS and r["prompt_tokens"] > 0, (name, leg, r)
            assert r["ttft_p50_ms"] is not None and r["output_tok_s"] > 0, (name, leg, r)
        assert "rr0" not in legs["rr"]["per_node"]  # nodes, not routes: round-robin reached all three
        assert len(legs["rr"]["per_node"]) == 3, legs["rr"]
        # The prefix leg was steered by the index: every request was a decision, counted.
        assert sum(legs["prefix"]["affinity"].values()) == REQUESTS, legs["prefix"]
        assert legs["least"]["affinity"] == {}, legs["least"]
        assert any(line.endswith(("PASS", "MISS")) for line in workload["verdicts"]), workload["verdicts"]
    # A conversation's later turns reuse what its node holds: the nodes report it cached.
    assert result["workloads"]["sessions"]["legs"]["prefix"]["cached_share"] > 0
    assert "### sessions" in proc.stdout and "| prefix |" in proc.stdout.replace("  ", " ")

"""``opbridge bench outputs``: runs, checks every candidate against the pool's result, reports faults."""

from __future__ import annotations

import argparse
import json

import pytest

from opbridge.bench import outputs


def test_quick_run_reports_every_candidate() -> None:
    result = outputs.run(argparse.Namespace(quick=True, frameworks=["numpy", "torch"], row_seconds=0.5))
    json.dumps(result)  # serialisable
    assert result["ok"] and result["rows"]
    for row in result["rows"]:
        assert set(row["stats_us"]) == {"pool", "aligned", "malloc", "existing"}
        assert set(row["faults_per_call"]) == set(row["stats_us"])
        assert row["malloc_over_pool"] > 0 and row["pool_over_existing"] > 0
    text = outputs.format_text(result)
    assert "malloc/pool" in text and "numpy  add" in text
    # both frameworks' native entries were built before the timing
    assert set(result["natives"]) == {"torch native kernels", "NumPy C entry"}, result["natives"]
    assert all(path.endswith(".so") for path in result["natives"].values()), result["natives"]


def test_a_wrong_candidate_is_an_error_not_a_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    fw = outputs._NumPy()
    monkeypatch.setattr(fw, "equal", lambda a, b: False)  # every candidate "differs" from the pool's result
    row = outputs._row(fw, "add", (4, 8), "float32", target_s=0.001, budget_s=0.01)
    assert row["error"].startswith("results differ from the pool's: pool, aligned, malloc, existing")
    assert "stats_us" not in row

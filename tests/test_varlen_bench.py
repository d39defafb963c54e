"""``slipstream bench varlen`` runs end to end on a tiny model and reports an exact match."""

from __future__ import annotations

import json

from slipstream.cli import main


def test_bench_varlen_reports_ratios_and_an_exact_loss(tmp_path):
    out = tmp_path / "r.json"
    argv = ["bench", "varlen", "--model", "llama-tiny", "--batch-size", "3", "--steps", "2", "--warmup", "0"]
    assert main(argv + ["--json", str(out), "--markdown", str(tmp_path / "r.md")]) == 0
    r = json.loads(out.read_text())
    assert r["ideal_ratio"] >= 1.0 and r["achieved_ratio"] > 0
    assert r["exactness"]["loss_rel_diff"] <= 1e-5
    assert r["exactness"]["grads_allclose_rtol1e-4_atol1e-6"]
    assert set(r["cases"]) == {"padded", "varlen"}
    assert "| varlen |" in (tmp_path / "r.md").read_text()

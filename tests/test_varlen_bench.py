"""``slipstream bench varlen`` runs end to end on a tiny model: varlen exact, the HF peer measured."""

from __future__ import annotations

import json
import math

from slipstream.cli import main


def test_bench_varlen_reports_three_cases_with_ratios_and_loss_differences(tmp_path):
    out = tmp_path / "r.json"
    argv = ["bench", "varlen", "--model", "llama-tiny", "--batch-size", "3", "--steps", "2", "--warmup", "0"]
    assert main(argv + ["--json", str(out), "--markdown", str(tmp_path / "r.md")]) == 0
    r = json.loads(out.read_text())
    assert r["ideal_ratio"] >= 1.0 and r["achieved_ratio"] > 0
    assert set(r["cases"]) == {"padded", "varlen", "hf_flatten"}
    for name in ("varlen", "hf_flatten"):
        assert len(r["cases"][name]["step_seconds"]) == 2
        assert r["cases"][name]["vs_padded"]["time_ratio"] > 0
    x = r["exactness"]["cases"]
    assert x["varlen"]["loss_rel_diff"] <= 1e-5
    assert x["varlen"]["grads_allclose_rtol1e-4_atol1e-6"]
    for name in ("hf_flatten", "hf_flatten_use_cache"):
        assert math.isfinite(x[name]["loss"])
        # the difference is computed against padded's loss, not copied from it
        assert math.isclose(x[name]["loss_abs_diff"], abs(x[name]["loss"] - x["padded"]["loss"]), abs_tol=1e-9)
        assert math.isfinite(x[name]["grad_max_abs_diff"])
    table = (tmp_path / "r.md").read_text()
    assert "| varlen |" in table and "| hf_flatten |" in table
    # the table says plainly which measured case is not exact, and only those
    for name in ("hf_flatten", "hf_flatten_use_cache"):
        exact = x[name]["loss_rel_diff"] <= 1e-5 and x[name]["grads_allclose_rtol1e-4_atol1e-6"]
        assert (f"**{name} is not exact**" in table) == (not exact)

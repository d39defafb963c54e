"""``slipstream env --json`` and ``slipstream tune --json`` on 1 node x 2 ranks."""

import json
import subprocess
import sys

import pytest

from slipstream.core_comm.collectives.shm import is_supported_platform


def _cli(*args, timeout=120):
    proc = subprocess.run([sys.executable, "-m", "slipstream.cli", *args], capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)  # stdout is only the JSON: the ranks' output went to stderr


@pytest.mark.slow
def test_env_json_reports_topology_fast_paths_routes_tuned_plan_and_versions(tmp_path):
    cache = str(tmp_path / "tuner")
    env = _cli("env", "--json", "--ranks-per-node", "2", "--cache-dir", cache)
    assert env["world_size"] == 2 and env["backend"] == "gloo"
    assert env["topology"]["num_nodes"] == 1 and env["topology"]["node_sizes"] == [2]
    assert [r["rank"] for r in env["topology"]["ranks"]] == [0, 1]
    paths = env["fast_paths"]
    assert set(paths) == {"shm", "hierarchical", "multi_connection", "cuda_staging"}
    assert paths["shm"]["active"] is is_supported_platform()
    assert not paths["hierarchical"]["active"] and paths["hierarchical"]["why_not"]
    assert not paths["multi_connection"]["active"] and paths["multi_connection"]["why_not"]
    route = env["routes"][0]
    assert {"kind", "size_bytes", "algorithm", "reason", "tuned_algorithm"} <= set(route)
    assert {r["kind"] for r in env["routes"]} == {"all_reduce", "reduce_scatter", "all_gather"}
    tuned = env["tuned"]
    assert tuned["source"] == "model" and tuned["cache_file"].startswith(cache)
    assert tuned["buckets"]["ddp"]["bucket_cap_mb"] > 0
    assert "reduce_bucket_size" in tuned["buckets"]["deepspeed"]["zero_optimization"]
    assert tuned["choices"]
    assert {"python", "torch", "slipstream", "deepspeed", "transformers", "accelerate"} <= set(env["versions"])
    assert env["versions"]["torch"]
    assert env["config"]["chunk_bytes"] > 0

    # After `slipstream tune`, env shows the cached plan: the same choices.
    tune = _cli("tune", "--json", "--ranks-per-node", "2", "--budget", "1", "--cache-dir", cache)
    assert tune["source"] == "measured" and tune["world_size"] == 2
    env = _cli("env", "--json", "--ranks-per-node", "2", "--cache-dir", cache)
    assert env["tuned"]["source"] == "cached"
    measured = {(e["kind"], e["nbytes"]): e["choice"]["algorithm"] for e in tune["plan"]["entries"]}
    assert {(c["kind"], c["nbytes"]): c["algorithm"] for c in env["tuned"]["choices"]} == measured


def test_env_json_prints_the_settings_of_slipstream_config(tmp_path, monkeypatch):
    path = tmp_path / "slipstream.json"
    path.write_text(json.dumps({"varlen": {"enabled": True}, "comm": {"chunk_bytes": 1 << 20}}))
    monkeypatch.setenv("SLIPSTREAM_CONFIG", str(path))
    env = _cli("env", "--json", "--ranks-per-node", "2", "--cache-dir", str(tmp_path / "tuner"))
    assert env["config"]["chunk_bytes"] == 1 << 20  # the communicator built from the file's comm part
    assert env["settings"]["comm"]["chunk_bytes"] == 1 << 20 and env["settings"]["varlen"]["backend"] == "auto"

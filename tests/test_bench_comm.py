"""``slipstream bench comm``: size parsing, nccl-tests arithmetic, and short real runs."""

from __future__ import annotations

import argparse
import json

import pytest

from slipstream.bench import comm
from slipstream.cli import main
from slipstream.cluster import ClusterSpec

REQUIRED = {"op", "size_bytes", "impl", "time_s", "algbw_gbps", "busbw_gbps", "bound_s"}


def _has_communicator() -> bool:
    try:
        from slipstream.core_comm import Communicator  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("text, nbytes", [("4K", 4096), ("64KiB", 65536), ("1M", 1 << 20), ("100", 100)])
def test_parse_size_uses_binary_units(text, nbytes):
    assert comm.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "K", "-4K", "0", "big"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        comm.parse_size(text)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"dtype": "float32", "link": None, **kw})


def test_busbw_and_memory_bound_follow_nccl_tests_on_one_node():
    raw = {"world_size": 4, "backend": "gloo", "records": [
        {"op": op, "size_bytes": 1 << 20, "impl": "stock", "times_s": [2e-3, 1e-3, 3e-3], "algorithm": "gloo"}
        for op in comm.OPS]}
    recs = {r["op"]: r for r in comm._records(raw, ClusterSpec(ranks_per_node=4), 1e9, _args())}
    algbw = (1 << 20) / 2e-3 / 1e9  # the median time is 2 ms
    assert recs["allreduce"]["busbw_gbps"] == pytest.approx(algbw * 1.5)
    assert recs["allgather"]["busbw_gbps"] == pytest.approx(algbw * 0.75)
    assert recs["reduce_scatter"]["busbw_gbps"] == pytest.approx(algbw * 0.75)
    assert recs["allreduce"]["bound_s"] == pytest.approx(8 * (1 << 20) / 1e9)
    assert recs["allgather"]["bound_s"] == pytest.approx(5 * (1 << 20) / 1e9)


def test_link_bound_counts_bytes_crossing_each_node_link():
    raw = {"world_size": 4, "backend": "gloo", "records": [
        {"op": op, "size_bytes": 64 << 20, "impl": "stock", "times_s": [1.0], "algorithm": "gloo"} for op in comm.OPS]}
    spec = ClusterSpec(nodes=2, ranks_per_node=2, link="1gbit")
    recs = {r["op"]: r for r in comm._records(raw, spec, 1e9, _args(link="1gbit"))}
    assert recs["allreduce"]["bound_s"] == pytest.approx(0.537, abs=1e-3)  # 64 MiB once
    assert recs["allgather"]["bound_s"] == pytest.approx(0.268, abs=1e-3)


def _run_short(tmp_path, impls: str, *extra: str) -> list[dict]:
    path = tmp_path / "out.json"
    argv = ["bench", "comm", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1",
            "--ranks-per-node", "2", "--impls", impls, "--json", str(path), *extra]
    assert main(argv) == 0
    return json.loads(path.read_text())


def test_short_run_writes_every_record(tmp_path):
    impls = "stock,slipstream" if _has_communicator() else "stock"
    records = _run_short(tmp_path, impls)
    assert {(r["op"], r["size_bytes"], r["impl"]) for r in records} == {
        (op, size, impl) for op in comm.OPS for size in (4096, 65536) for impl in impls.split(",")}
    for r in records:
        assert REQUIRED <= set(r)
        assert r["time_s"] > 0 and r["busbw_gbps"] > 0 and r["bound_s"] > 0


@pytest.mark.netns
def test_short_run_across_two_emulated_nodes(tmp_path):
    records = _run_short(tmp_path, "stock", "--nodes", "2", "--link", "1gbit", "--ranks-per-node", "1",
                         "--ops", "allreduce")
    assert [r["size_bytes"] for r in records] == [4096, 65536]
    assert all(r["nodes"] == 2 and r["link"] == "1gbit" for r in records)


def test_multi_node_needs_a_link():
    with pytest.raises(SystemExit, match="--link"):
        main(["bench", "comm", "--nodes", "2"])

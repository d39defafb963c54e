"""``slipstream bench comm``: size parsing, nccl-tests arithmetic, and short real runs."""

from __future__ import annotations

import argparse
import json

import pytest

from slipstream.bench import comm, report
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
    assert report.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "K", "-4K", "0", "big"])
def test_parse_size_rejects_garbage(text):
    with pytest.raises(ValueError):
        report.parse_size(text)


@pytest.mark.parametrize("nbytes, text", [(4096, "4 KiB"), (3 << 20, "3 MiB"), (1 << 30, "1 GiB"), (1536, "1536 B")])
def test_format_size_names_the_largest_binary_unit_that_divides(nbytes, text):
    assert report.format_size(nbytes) == text
    assert report.parse_size(text) == nbytes


def test_table_heads_aligns_and_lines_up_cells():
    assert report.table(["op", "time (us)"], "lr", [["allreduce", 1.5], ["allgather", ""]]) == [
        "| op | time (us) |", "|---|---:|", "| allreduce | 1.5 |", "| allgather |  |"]


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
    assert all(r["vs_stock"] == 1.0 for r in recs.values())


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
    bus_factor = {"allreduce": 2 * (2 - 1) / 2, "allgather": (2 - 1) / 2, "reduce_scatter": (2 - 1) / 2}  # nccl-tests
    for r in records:
        assert REQUIRED <= set(r)
        assert r["algorithm"] == {"stock": "gloo", "slipstream": "shm"}[r["impl"]], r  # what ran is what is named
        assert r["algbw_gbps"] == pytest.approx(r["size_bytes"] / r["time_s"] / 1e9, rel=1e-9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bus_factor[r["op"]], rel=1e-9)
        assert 0 < r["bound_s"] < r["time_s"]


def _deepspeed_reason() -> str | None:
    """Why DeepSpeed's shm allreduce cannot run here (None: it can); builds it the first time."""
    import torch

    from slipstream.bench.workers import deepspeed_shm

    return deepspeed_shm.prepare(torch.float32, nodes=1).reason


@pytest.mark.slow
def test_short_run_adds_deepspeed_shm_allreduce_checked_against_gloo(tmp_path):
    reason = _deepspeed_reason()
    if reason:
        pytest.skip(f"DeepSpeed's shm allreduce is not available: {reason}")
    records = _run_short(tmp_path, "stock,deepspeed", "--ops", "allreduce,allgather")
    # the worker raises (and the run fails) when deepspeed's sums differ from gloo's
    ds = [r for r in records if r["impl"] == "deepspeed"]
    assert [(r["op"], r["size_bytes"]) for r in ds] == [("allreduce", 4096), ("allreduce", 65536)]
    for r in ds:
        assert r["time_s"] > 0 and r["vs_stock"] > 0 and r["setup_s"] > 0
        assert r["algorithm"].startswith("shm")
    assert {r["impl"] for r in records if r["op"] == "allgather"} == {"stock"}


@pytest.mark.parametrize("nodes, dtype, why", [(2, "float32", "one node"), (1, "float64", "unreduced")])
def test_deepspeed_peer_is_dropped_with_a_reason_where_it_cannot_run(nodes, dtype, why):
    impls = ["stock", "deepspeed"]
    spec = ClusterSpec(nodes=nodes, ranks_per_node=1, link="1gbit" if nodes > 1 else None)
    ds = comm._deepspeed_peer(impls, _args(dtype=dtype), spec)
    assert impls == ["stock"]
    assert why in comm._peer_line(ds) and comm._peer_line(ds).startswith("deepspeed: absent: ")


@pytest.mark.netns
def test_short_run_across_two_emulated_nodes(tmp_path):
    records = _run_short(tmp_path, "stock", "--nodes", "2", "--link", "1gbit", "--ranks-per-node", "1",
                         "--ops", "allreduce")
    assert [r["size_bytes"] for r in records] == [4096, 65536]
    assert all(r["nodes"] == 2 and r["link"] == "1gbit" for r in records)


def test_multi_node_needs_a_link():
    with pytest.raises(SystemExit, match="--link"):
        main(["bench", "comm", "--nodes", "2"])

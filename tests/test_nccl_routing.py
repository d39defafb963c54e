"""On a group with NCCL, a CUDA tensor takes the stack's own path, unchanged: the routing
decision over every device, backend, op and dtype; every wrapper of a stock handle waits
through the stock ``wait()``; every entry point asks the decision before it builds anything;
ZeRO-2 sends DeepSpeed's own bytes. Without a GPU, an NCCL group is a gloo group whose backend
is reported as ``nccl`` (``routing.backend_of``, the decision's one input about the group), and
a device tensor's handle is a stand-in ``Work`` whose future completes at once, as NCCL's does
when the kernel is queued."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from slipstream.core_comm import CommConfig, Work
from slipstream.core_comm.routing import decide
from slipstream.plugins.fsdp.overlap import param_groups

ReduceOp = dist.ReduceOp

# What serves each device's tensors on a group of each kind (what ``backend_of`` reports).
GROUPS = {
    "gloo": {"cpu": "gloo", "cuda": "gloo"},
    "nccl": {"cpu": None, "cuda": "nccl"},
    "cpu:gloo,cuda:nccl": {"cpu": "gloo", "cuda": "nccl"},
    "slipstream over gloo": {"cpu": "slipstream", "cuda": "slipstream"},  # no NCCL built: CUDA staged
    "slipstream over nccl": {"cpu": "slipstream", "cuda": "nccl"},
}
OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN,
       "product": ReduceOp.PRODUCT, "premul_sum": dist._make_nccl_premul_sum(0.5)}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8,
          torch.int8, torch.int16, torch.bool, torch.complex64]
# The dtypes the shared-memory kernels reduce, and the ops defined only on floating dtypes.
REDUCED = {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8}
FLOAT_ONLY = {"avg", "premul_sum"}


def _expected(device: str, group: str, op: str, dtype, *, staging: bool = True) -> str:
    """The rule as the issue states it, written out: the core only where the group's backend
    for the device is a host-memory one (gloo, slipstream without NCCL), CUDA only staged."""
    backend = GROUPS[group][device]
    if backend not in ("gloo", "slipstream") or (device == "cuda" and not staging):
        return "stock"
    if dtype not in REDUCED or (op in FLOAT_ONLY and not dtype.is_floating_point):
        return "stock"
    return "core"


@pytest.mark.parametrize("group", list(GROUPS))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_decision_over_every_device_group_op_and_dtype(device, group):
    config = CommConfig()
    for (op_name, op), dtype in itertools.product(OPS.items(), DTYPES):
        why = decide(device, GROUPS[group][device], op, dtype, config=config)
        assert ("core" if why is None else "stock") == _expected(device, group, op_name, dtype), \
            (device, group, op_name, dtype, why)
        if GROUPS[group][device] == "nccl":
            assert "nccl" in why  # the reason names what kept it
    for op, dtype in itertools.product(OPS.values(), (torch.float32, torch.bfloat16)):
        why = decide(device, GROUPS[group][device], op, dtype, config=CommConfig(cuda_staging=False))
        assert ("core" if why is None else "stock") == _expected(device, group, "sum", dtype, staging=False)


def test_the_decision_leaves_other_devices_and_disabled_paths_stock():
    assert "not supported" in decide("xpu", "gloo", ReduceOp.SUM, torch.float32, config=CommConfig())
    assert "xccl" in decide("xpu", "xccl", ReduceOp.SUM, torch.float32, config=CommConfig())
    assert "disabled" in decide("cpu", "gloo", ReduceOp.SUM, torch.float32, config=CommConfig(shm=False))
    assert "mpi" in decide("cuda", "mpi", ReduceOp.SUM, torch.float32, config=CommConfig())  # CUDA-aware MPI keeps it
    assert decide("cpu", "mpi", ReduceOp.SUM, torch.float32, config=CommConfig()) is None


def test_a_group_of_one_rank_on_nccl_keeps_nccls_handle():
    """One rank: the core's local copy would run on its worker, a handle the waiter's stream
    knows nothing of; NCCL's own keeps the streams ordered."""
    from slipstream.core_comm.routing import route

    def path(backend, world=1):
        return route("all_gather", torch.ones(4), ReduceOp.SUM, world=world, config=CommConfig(), backend=backend,
                     plan=None, hierarchical=False, intra=False, unavailable="")[0]

    assert path("nccl") == "stock" and path("nccl", world=4) == "stock"
    assert path("gloo") == "local" and path("slipstream") == "local"


def _backends(rank, world):
    import slipstream  # noqa: F401 - registers the backend
    from slipstream.core_comm.routing import backend_of

    made = {"gloo": dist.new_group([0, 1]), "cpu:gloo": dist.new_group([0, 1], backend="cpu:gloo"),
            "slipstream": dist.new_group([0, 1], backend="slipstream"),
            "cpu:slipstream,cuda:gloo": dist.new_group([0, 1], backend="cpu:slipstream,cuda:gloo")}
    return {name: (backend_of(g, "cpu"), backend_of(g, "cuda")) for name, g in made.items()} | {
        "world": (backend_of(None, "cpu"), backend_of(None, "cuda"))}


def test_each_group_reports_the_backend_that_serves_each_device():
    got = run_ranks(_backends, 2, timeout=120)[0]
    # No CUDA here: a slipstream group built no NCCL, so its CUDA tensors would be staged. torch
    # hands a group named with slipstream for any device the slipstream group itself (its
    # creator makes a whole ProcessGroup), so that group answers for CUDA too.
    assert got == {"gloo": ("gloo", "gloo"), "cpu:gloo": ("gloo", None), "slipstream": ("slipstream", "slipstream"),
                   "cpu:slipstream,cuda:gloo": ("slipstream", "slipstream"), "world": ("gloo", "gloo")}


# ---------------------------------------------------------------- wrappers of a stock handle


class _StandIn(dist.Work):
    """A stock handle of device tensors: its future completes at once (NCCL's, at enqueue);
    only ``wait()`` would make the waiter's stream wait for the data. Records who waited."""

    def __init__(self) -> None:
        super().__init__()
        self.waited_on: list = []

    def wait(self, timeout=None) -> bool:
        self.waited_on.append(threading.current_thread())
        return True

    def get_future(self):
        future = torch.futures.Future()
        future.set_result([])
        return future


def _assert_waits_through(wrapper, *stock: _StandIn) -> None:
    assert all(not s.waited_on for s in stock)
    assert not wrapper.is_completed()  # not from the stock future, which completed at once
    wrapper.wait()
    for s in stock:
        assert s.waited_on == [threading.current_thread()], "the stock wait() was not called by the waiter"
    assert wrapper.is_completed()


def test_every_wrapper_of_a_stock_handle_waits_through_its_wait():
    from slipstream.core_comm.backend.process_group import SlipstreamProcessGroup
    from slipstream.core_comm.communicator import Communicator, _stock

    ran = []
    stock = _StandIn()
    _assert_waits_through(Work.after(stock, lambda: ran.append("then"), on_wait=True), stock)
    assert ran == ["then"]  # after the stock wait, on the waiter

    stock = _StandIn()
    _assert_waits_through(Work.after(stock, on_wait=True).returning([1]), stock)

    several = [_StandIn(), _StandIn()]
    _assert_waits_through(Work.of_stock(several, result=[2]), *several)

    # the core's own stock path with a device tensor (meta stands in for CUDA): its copy-back
    # runs after the stock wait, and a coalesced call's unflatten after that
    stock = _StandIn()
    device = torch.empty(4, device="meta")
    wrapped = _stock(stock, device, device, 0.0)
    _assert_waits_through(Communicator._then(wrapped, lambda: ran.append("unflatten"), device.device), stock)
    assert ran[-1] == "unflatten"

    # the backend's coalesced call that stays stock: one Work over each pair's stock handle
    handles = [_StandIn(), _StandIn()]
    calls = iter(handles)
    work = SlipstreamProcessGroup._stock_coalesced(lambda o, i, opts: next(calls), [0, 1], [0, 1], None)
    _assert_waits_through(work, *handles)


def test_a_cpu_stock_handle_completes_from_its_future_as_before():
    """gloo's future completes when the data is there: the core keeps completing from it, so
    DDP's reducer is not made to block in ``get_future()``."""
    from slipstream.core_comm.communicator import _stock

    stock = _StandIn()
    host = torch.empty(4)
    work = _stock(stock, host, host, 0.0)
    assert work.is_completed() and not stock.waited_on


# ---------------------------------------------------------------- every entry point asks


def _recorder(names):
    """Wrap ``torch.distributed``'s ``names``: every handle a stock call returns, in order."""
    handed = []
    for name in names:
        real = getattr(dist, name)

        def recorded(*args, _real=real, **kwargs):
            work = _real(*args, **kwargs)
            handed.append(work)
            return work

        setattr(dist, name, recorded)
    return handed


def _stand_in_nccl():
    """Every group reports NCCL for every device (the slipstream backend's groups too)."""
    from slipstream.core_comm import routing
    from slipstream.core_comm.backend.process_group import SlipstreamProcessGroup

    routing.backend_of = lambda group, device_type: "nccl"
    SlipstreamProcessGroup.device_backend = lambda self, device_type: "nccl"


def _entry_points(rank, world, nccl: bool):
    import slipstream
    from slipstream.core_comm import counters, pool
    from slipstream.plugins.fsdp import fsdp1, fsdp2

    if nccl:
        _stand_in_nccl()
    handed = _recorder(["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"])
    counters.reset()
    group = dist.new_group([0, 1])
    ours = dist.new_group([0, 1], backend="slipstream")
    x = torch.arange(12.0) + rank
    gathered_ref = torch.cat([torch.arange(6.0) + r for r in range(world)])
    summed_ref = sum(torch.arange(12.0) + r for r in range(world))
    out: dict = {}
    stock = {}

    def check(name, work, result, ref, returned_is_stock=True):
        if work is not None and returned_is_stock:
            stock[name] = handed and work is handed[-1]
        if work is not None:
            work.wait()
        torch.testing.assert_close(result, ref)

    # the pool, as every adapter asks it
    out["pool"] = pool.for_call(group, x, kind="all_reduce") is None
    # the backend, and Megatron's coalesced calls through it
    t = x.clone()
    work = dist.all_reduce(t, group=ours, async_op=True)
    out["backend_is_core_work"] = isinstance(work, Work)
    check("backend", work, t, summed_ref, returned_is_stock=False)
    outs = [torch.empty(12), torch.empty(8)]
    with dist._coalescing_manager(group=ours, async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.arange(6.0) + rank, group=ours)
        dist.all_gather_into_tensor(outs[1], torch.arange(4.0) + rank, group=ours)
    cm.wait()
    torch.testing.assert_close(outs[0], gathered_ref)
    # FSDP2's comm objects and HSDP's all-reduce across replicas
    gather, scatter = fsdp2._classes()
    o = torch.empty(12)
    check("fsdp2_all_gather", gather()(o, torch.arange(6.0) + rank, group, async_op=True), o, gathered_ref)
    o = torch.empty(6)
    check("fsdp2_reduce_scatter", scatter()(o, x.clone(), group, ReduceOp.SUM, async_op=True), o,
          summed_ref.view(world, 6)[rank])
    routes = fsdp2._HsdpAllReduce()
    routes.groups[id(group)] = [group, None, 1, None]  # group, config, modules routed, deferral
    t = x.clone()
    check("hsdp_all_reduce", fsdp2._DistView(routes).all_reduce(t, group=group, async_op=True), t, summed_ref)
    # FSDP1's hook
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState

    o = torch.empty(6)
    fsdp1.slipstream_fsdp1_hook(DefaultState(group), x.clone(), o)
    torch.testing.assert_close(o, summed_ref.view(world, 6)[rank] / world)
    # the DDP hook, against DDP's own averaging
    torch.manual_seed(0)
    model = torch.nn.Linear(12, 3)
    plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(12, 3), process_group=group)
    plain.module.load_state_dict(model.state_dict())
    hooked = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    hooked.register_comm_hook(slipstream.DDPHookState(group), slipstream.ddp_hook)
    for m in (plain, hooked):
        m(x.view(1, 12)).sum().backward()
    for a, b in zip(hooked.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    out["communicators"] = len(pool.items())
    out["stayed"] = [why for _, why in pool.stayed()]
    out["paths"] = {path for kind in counters.snapshot().values() for path in kind}
    out["stock_handles"] = stock
    return out


@pytest.mark.parametrize("nccl", [True, False], ids=["group-reports-nccl", "gloo"])
def test_every_entry_point_asks_the_decision_before_building_anything(nccl):
    got = run_ranks(_entry_points, 2, nccl, timeout=240)
    for out in got:
        if nccl:
            assert out["communicators"] == 0, "an entry point built a communicator for a group on NCCL"
            assert out["pool"] and not out["backend_is_core_work"]
            assert out["paths"] == {"stock"}, out["paths"]
            # the stack's own handle, as it is: no CPU future completed at enqueue
            assert out["stock_handles"] == dict.fromkeys(["fsdp2_all_gather", "fsdp2_reduce_scatter",
                                                          "hsdp_all_reduce"], True)
            assert out["stayed"] and all("nccl" in why["cpu"] for why in out["stayed"])
        else:  # the same calls on gloo: the core takes them (so the assertions above can fail)
            assert out["communicators"] >= 2 and not out["pool"] and out["backend_is_core_work"]
            assert out["paths"] & {"shm", "cma"}
            assert not any(out["stock_handles"].values())


# ---------------------------------------------------------------- ZeRO-2 on NCCL: DeepSpeed's bytes


def _bytes_of(name, args, kwargs) -> int:
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    big = max(tensors, key=torch.Tensor.numel)  # the all-gather's output, the reduce-scatter's input
    return big.numel() * big.element_size()


def _zero2_bytes(rank, world):
    """Three ZeRO-2 steps stock, with the section on a group reporting NCCL, and with the
    section on gloo; what each sent through torch.distributed, and the losses."""
    import deepspeed

    import slipstream.deepspeed as sds
    from slipstream.core_comm import counters, pool, routing
    from slipstream.core_comm.backend.process_group import SlipstreamProcessGroup

    sent: list = []
    names = ["all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "all_gather"]
    for name in names:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            sent.append((_name, _bytes_of(_name, args, kwargs)))
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    deepspeed.init_distributed(dist_backend="gloo")  # binds the counted functions

    def train(section):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 31))
        cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
               "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
               "zero_optimization": {"stage": 2, "reduce_bucket_size": 1500, "allgather_bucket_size": 1500},
               "zero_force_ds_cpu_optimizer": False}
        if section is not None:
            cfg["slipstream"] = section
        engine, *_ = (sds.initialize if section else deepspeed.initialize)(
            model=model, model_parameters=model.parameters(), config=cfg)
        del sent[:]
        losses = []
        for step in range(3):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 32, generator=g), torch.randn(4, 31, generator=g)
            loss = (engine(x) - y).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses, list(sent)

    section = {"enabled": True, "comm": {"slot_bytes": 4096, "small_bytes": 512, "chunk_bytes": 4096}}
    stock_losses, stock_sent = train(None)
    real_backend_of, real_device_backend = routing.backend_of, SlipstreamProcessGroup.device_backend
    _stand_in_nccl()
    counters.reset()
    nccl_losses, nccl_sent = train(section)
    import deepspeed.comm as ds_comm

    gathered = torch.empty(2 * 5)
    handle = ds_comm.all_gather_into_tensor(gathered, torch.full((5,), float(rank)), async_op=True)
    handle.wait()
    nccl = {"communicators": len(pool.items()), "paths": counters.snapshot(), "stack": _status_line(),
            "handle_is_stock": not isinstance(handle, Work) and torch.equal(gathered, torch.arange(2.0).repeat_interleave(5))}
    routing.backend_of, SlipstreamProcessGroup.device_backend = real_backend_of, real_device_backend
    pool.close_all()
    counters.reset()
    gloo_losses, _ = train(section)
    gloo_paths = counters.snapshot()
    _uninstall()
    return {"stock": (stock_losses, stock_sent), "nccl": (nccl_losses, nccl_sent), "nccl_facts": nccl,
            "gloo": (gloo_losses, gloo_paths)}


def _status_line() -> str:
    from slipstream import _status

    return _status.line()


def _uninstall() -> None:
    from slipstream.plugins.deepspeed import uninstall

    uninstall()


def test_zero2_on_a_group_with_nccl_sends_deepspeeds_own_bytes():
    pytest.importorskip("deepspeed")
    env = [{"LOCAL_RANK": str(r), "SLIPSTREAM_NODE": "0"} for r in range(2)]
    for got in run_ranks(_zero2_bytes, 2, rank_env=env, timeout=400):
        stock_losses, stock_sent = got["stock"]
        nccl_losses, nccl_sent = got["nccl"]
        assert stock_sent and nccl_sent == stock_sent, "not DeepSpeed's own calls and bytes"
        assert nccl_losses == stock_losses  # the same calls in the same order: bit-equal
        facts = got["nccl_facts"]
        assert facts["communicators"] == 0 and facts["handle_is_stock"]
        assert all(set(paths) == {"stock"} for paths in facts["paths"].values()), facts["paths"]
        assert "DeepSpeed's own" in facts["stack"] and "nccl" in facts["stack"], facts["stack"]
        # on gloo the core reduces the buckets to their owners: the comparison above can fail
        gloo_losses, gloo_paths = got["gloo"]
        assert set(gloo_paths["reduce_scatter"]) - {"stock"}, gloo_paths
        torch.testing.assert_close(torch.tensor(gloo_losses), torch.tensor(stock_losses), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- FSDP2 on NCCL: left as it is


def _fsdp2_left_alone(rank, world):
    from torch.distributed.fsdp import fully_shard

    from slipstream import fsdp
    from slipstream.core_comm import pool

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 40), torch.nn.GELU(), torch.nn.Linear(40, 16))
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        return model

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(2):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    stock = train(build())
    _stand_in_nccl()
    model = build()
    groups = [g for m in model.modules() if hasattr(m, "_get_fsdp_state") for g in param_groups(m._get_fsdp_state())]
    comms = [(g._all_gather_comm, g._reduce_scatter_comm, g.unshard_async_op) for g in groups]
    switched = fsdp.apply(model, config=CommConfig(overlap=True))
    after = [(g._all_gather_comm, g._reduce_scatter_comm, g.unshard_async_op) for g in groups]
    from slipstream._common.record import stacks

    return {"switched": switched, "untouched": after == comms, "losses": (train(model), stock),
            "communicators": len(pool.items()), "kept": stacks()["fsdp"].get("modules_left_to_fsdp")}


def test_fsdp2_modules_on_a_group_with_nccl_keep_fsdps_comms_and_overlap():
    for got in run_ranks(_fsdp2_left_alone, 2, timeout=240):
        assert got["switched"] == [] and got["untouched"], "FSDP2's comms or its unshard_async_op were changed"
        assert got["losses"][0] == got["losses"][1]
        assert got["communicators"] == 0
        assert got["kept"].startswith("3 (") and "nccl" in got["kept"], got["kept"]

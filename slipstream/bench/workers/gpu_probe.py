"""The stream-race probe of ``slipstream bench gpu``: does waiting on what an entry point
returns make the waiting stream wait for the collective's data?

One probe, for every wrapper: the input is pre-filled with -1 and the output with NaN (an
in-place all-reduce's buffer is both, pre-filled with -1); on a side stream the probe sleeps
(``torch.cuda._sleep``, ~0.5 s), writes the input (rank + 1) and issues the async call through
the entry point's public surface; back on the waiting stream (the default one) it waits on the
returned handle or future as that entry point's consumer does, and copies every output at once.
In the copy, NaN means the output was read before the collective wrote it (the wait did not
order the waiting stream after the collective); -1 means the collective read its input before
the side stream wrote it (the call did not order itself after the stream it was issued on).
Both are races. Any other wrong value is reported as wrong. A control with no wait at all must
show a race, or the probe proves nothing on this machine (its sleep was too short).

Layouts: ``one_rank`` runs in this process on a 1-rank group (NCCL for CUDA tensors, gloo on a
CPU dry run); ``staged`` is a rank's part on ranks sharing one GPU over gloo with CUDA tensors,
the core's staged path (``gpu_comm.py`` runs it). On CPU tensors nothing is asynchronous on a
device: the probe then checks the values only.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from slipstream.core_comm.compat import all_gather_into_tensor as _all_gather  # torch 2.13's or 2.11's name

__all__ = ["Probe", "one_rank", "probe", "probe_all", "row", "staged", "verdict", "wrappers"]

SLEEP_CYCLES = 1 << 30
"""~0.5 s at an H100's 1.98 GHz boost clock: far longer than issuing any of the calls takes."""

NUMEL = 1 << 20
"""Elements of each input: 4 MiB of float32, a copy of some tens of microseconds on a GPU."""


@dataclass(frozen=True)
class Probe:
    """One wrapper: ``issue(outputs, inputs)`` returns its handle; ``wait(handle)`` waits as its
    consumer does. ``reduce``: an in-place average (the outputs are the inputs), else an
    all-gather of each input into its output."""

    name: str
    issue: Callable[[list, list], Any]
    wait: Callable[[Any], Any] = lambda handle: handle.wait()
    pairs: int = 1
    reduce: bool = False


class _Bucket:
    """What ``ddp_hook`` reads of DDP's ``GradBucket``: the flat buffer."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer


def probe(p: Probe, device: torch.device, group=None, *, wait: bool = True) -> dict:
    """Run probe ``p`` once on this rank of ``group`` (every rank calls it): ``{"name", "race",
    "result"}``; ``wait=False`` copies the outputs without waiting (the control that must race)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = NUMEL if device.type == "cuda" else 4096
    inputs = [torch.full((numel,), -1.0, device=device) for _ in range(p.pairs)]
    outputs = inputs if p.reduce else [torch.full((world * numel,), float("nan"), device=device) for _ in inputs]
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)
    with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
        if cuda:
            torch.cuda._sleep(SLEEP_CYCLES)
        for t in inputs:
            t.fill_(rank + 1)
        handle = p.issue(outputs, inputs)
    if wait:
        p.wait(handle)
    seen = torch.cat([o.reshape(-1) for o in outputs])  # on the waiting stream, at once
    if cuda:
        torch.cuda.synchronize(device)
    if not wait:
        p.wait(handle)  # the control's collective finishes before the next probe
    expected = _expected(p, world, numel, device)
    return _verdict(p.name, int(seen.isnan().sum()), int((seen == -1).sum()), int((seen != expected).sum()),
                    seen.numel())


def _expected(p: Probe, world: int, numel: int, device) -> torch.Tensor:
    if p.reduce:
        return torch.full((numel * p.pairs,), (world + 1) / 2, device=device)
    gathered = torch.arange(1, world + 1, dtype=torch.float32, device=device).repeat_interleave(numel)
    return gathered.repeat(p.pairs)


def _verdict(name: str, nan: int, stale: int, wrong: int, total: int) -> dict:
    if nan:
        return {"name": name, "race": True,
                "result": f"race: {nan} of {total} elements NaN (read before the collective wrote them)"}
    if stale:
        return {"name": name, "race": True,
                "result": f"race: {stale} of {total} elements -1 (the collective read its input before the side "
                          "stream wrote it)"}
    if wrong:
        return {"name": name, "race": False, "result": f"wrong values: {wrong} of {total} elements"}
    return {"name": name, "race": False, "result": "no race"}


def _ds_stand_in(device: torch.device):
    """DeepSpeed's backend object with slipstream's stand-in installed; or why not (a string)."""
    if device.type == "cpu":
        # DeepSpeed's CPU accelerator JIT-builds its shm op in init_distributed (~1.5 min on 2 cores)
        return "skipped on CPU: DeepSpeed's CPU accelerator builds its shm op first (minutes)"
    try:
        import deepspeed
    except ImportError:
        return "skipped: DeepSpeed is not installed"
    from slipstream.core_comm import pool
    from slipstream.plugins.deepspeed.comm_backend import install_comm

    deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    return install_comm(pool.default_config())


def wrappers(group, device, slip_group=None, ds=None) -> list[Probe]:
    """The async entry points on ``group``: the stock handle (the control), the core's pool,
    FSDP2's custom all-gather, the DDP hook; with ``slip_group`` the slipstream backend's plain
    and coalesced forms, with ``ds`` DeepSpeed's stand-in."""
    from slipstream.core_comm import pool
    from slipstream.core_comm.backend.ddp_hook import ddp_hook
    from slipstream.plugins.fsdp.fsdp2 import SlipstreamAllGather

    backends = dict(part.split(":") for part in str(dist.get_backend(group)).split(",") if ":" in part)
    stock = backends.get(device.type, dist.get_backend(group))  # "cpu:gloo,cuda:nccl": the device's own
    found = [
        Probe(f"stock {stock} handle (the control)", lambda o, i: _all_gather(o[0], i[0], group=group, async_op=True)),
        Probe("pool.get(group).all_gather", lambda o, i: pool.get(group).all_gather(o[0], i[0], async_op=True)),
        Probe("pool.get(group).all_gather_coalesced",
              lambda o, i: pool.get(group).all_gather_coalesced(o, i, async_op=True), pairs=2),
        Probe("FSDP2 SlipstreamAllGather()", lambda o, i: SlipstreamAllGather()(o[0], i[0], group, async_op=True)),
        Probe("slipstream.ddp_hook future", lambda o, i: ddp_hook(group, _Bucket(i[0])),
              wait=lambda fut: fut.wait(), reduce=True),
    ]
    if slip_group is not None:
        found[1:1] = [
            Probe("slipstream backend: dist.all_gather_into_tensor",
                  lambda o, i: _all_gather(o[0], i[0], group=slip_group, async_op=True)),
            Probe("slipstream backend: _coalescing_manager", lambda o, i: _coalesced(slip_group, o, i), pairs=2),
        ]
    if ds is not None:
        found.append(Probe("DeepSpeed CommBackend.all_gather_into_tensor",
                           lambda o, i: ds.all_gather_into_tensor(o[0], i[0], group=group, async_op=True)))
    return found


def _coalesced(group, outputs, inputs):
    with dist._coalescing_manager(group=group, async_ops=True) as cm:
        for o, i in zip(outputs, inputs):
            _all_gather(o, i, group=group)
    return cm


def _ddp_grads(name: str, group, device) -> dict:
    """A DDP model with ``register_comm_hook(group, slipstream.ddp_hook)``: its gradients against
    the same model's without DDP (one step, the same batch on every rank: the average is it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slipstream.core_comm.backend.ddp_hook import ddp_hook

    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(device)
    model = DDP(copy.deepcopy(plain), process_group=group,
                device_ids=[device.index] if device.type == "cuda" else None)
    model.register_comm_hook(group, ddp_hook)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(device)
    for m in (plain, model):
        m(x).square().mean().backward()
    worst = max((a.grad - b.grad).abs().max().item() for a, b in zip(plain.parameters(), model.module.parameters()))
    ok = worst <= 1e-5
    return {"name": name, "race": not ok,
            "result": "gradients equal the model's without DDP" if ok else f"gradients differ by up to {worst:.3g}"}


def _guarded(name: str, run: Callable[[], dict]) -> dict:
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - one wrapper's failure is its row, the others still run
        return {"name": name, "race": None, "result": f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}


def probe_all(group, device, slip_group=None, ds=None, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Every wrapper of ``wrappers`` probed, the DDP model's gradients checked, and on a GPU the
    stock handle without a wait (the control that must race); ``on_result(r)`` after each."""
    probes = wrappers(group, device, slip_group, ds)
    checks = [(p.name, lambda p=p: probe(p, device, group)) for p in probes]
    ddp = "DDP model with register_comm_hook(ddp_hook)"
    checks.append((ddp, lambda: _ddp_grads(ddp, group, device)))
    if device.type == "cuda":
        control = probes[0]
        no_wait = Probe(f"{control.name.split(' (')[0]} without a wait (must race)", control.issue, control.wait)
        checks.append((no_wait.name, lambda: probe(no_wait, device, group, wait=False)))
    results = []
    for name, check in checks:
        results.append(_guarded(name, check))
        if on_result is not None:
            on_result(results[-1])
    return results


def one_rank(device: torch.device, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Every wrapper on a 1-rank group in this process: NCCL for CUDA tensors (gloo for CPU
    ones), a slipstream group made by ``new_group(backend="slipstream")``, DeepSpeed's stand-in;
    ``on_result(r)`` after each (what a stage records before a hang could stop it)."""
    import slipstream  # noqa: F401 - registers the slipstream backend

    from slipstream.core_comm import pool

    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    ds = None
    try:
        slip = dist.new_group(backend="slipstream")
        try:
            ds = _ds_stand_in(device)
            ds, ds_why = (None, ds) if isinstance(ds, str) else (ds, "")
        except Exception as e:  # noqa: BLE001 - the other wrappers still run
            ds_why = f"FAILED: DeepSpeed's set-up: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        results = probe_all(None, device, slip, ds, on_result)
        if ds is None:
            results.append({"name": "DeepSpeed CommBackend.all_gather_into_tensor", "race": None, "result": ds_why})
            if on_result is not None:
                on_result(results[-1])
        return results
    finally:
        if ds is not None:
            from slipstream.plugins.deepspeed.comm_backend import uninstall_comm

            uninstall_comm()
        pool.close_all()
        dist.destroy_process_group()


def staged(device: torch.device, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Rank body: every wrapper on the world's group (gloo, with CUDA tensors where ``device`` is
    a GPU: the core stages them), each result merged over the ranks (a race on any rank is a
    race) before ``on_result``, on every rank."""
    merged = []

    def merge(r: dict) -> None:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, r)
        bad = [x for x in every if x["race"] or x["result"] != every[0]["result"]]
        merged.append({**every[0], **(bad[0] if bad else {}), "race": any(x["race"] for x in every)})
        if on_result is not None:
            on_result(merged[-1])

    probe_all(None, device, on_result=merge)
    return merged


def row(r: dict) -> tuple[str, str]:
    """A probe's result as a table's (result, detail): "race: 12 of ..." -> ("race", "12 of ...")."""
    head, sep, rest = r["result"].partition(": ")
    if sep and (head in ("race", "FAILED", "wrong values") or head.startswith("skipped")):
        return head, rest
    return r["result"], ""


def verdict(results: list[dict], cuda: bool) -> tuple[str, str]:
    """(result, detail) over a layout's probes: how many wrappers race, or why the probe is
    inconclusive (its control without a wait did not race: the sleep was too short)."""
    if not cuda:
        return "values only", "CPU tensors: nothing runs on a device stream"
    controls = [r for r in results if "without a wait" in r["name"]]
    races = [r["name"] for r in results if r["race"] and r not in controls]
    if not controls or not all(r["race"] for r in controls):
        return "INCONCLUSIVE", "the control without a wait did not race (the sleep was too short)"
    if races:
        return f"{len(races)} wrapper(s) race", "; ".join(races)
    return "no wrapper races", "the control without a wait raced: the probe sees a race where there is one"

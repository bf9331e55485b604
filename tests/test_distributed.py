"""The distributed engines around fxopt: two CPU processes with gloo (loopback, spawn).

Each test runs the same engine on the unoptimized and the optimized model from the same weights and
data, takes a few SGD steps, and requires the same parameters on every rank: `DDP(fxopt.optimize(...))`
with a memory budget, `DDP(torch.compile(model, backend="fxopt"))` (Inductor: slow), and FSDP2
`fully_shard(fxopt.optimize(...))`; each with and without bfloat16 autocast around the step.
"""
from __future__ import annotations

import copy
import datetime
import faulthandler
import gc
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fxopt

pytestmark = pytest.mark.distributed

WORLD = 2
STEPS = 3
# A crash in one process leaves the other waiting in a collective: every wait is bounded, so a bug
# fails the test instead of hanging CI (a hung run once used the whole CI time). The bounds leave
# room for a loaded machine (a test takes ~5 s alone, up to ~60 s on 2 busy cores); a process still
# running shortly before the deadline prints every thread's stack, so a hang says where it waits.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
TEST_DEADLINE_S = 300


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 10)).train()


def batches(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data, the same for both models
    return [torch.randn(4, 3, 8, 8, generator=gen) for _ in range(STEPS)]


def train(model: nn.Module, data: list[torch.Tensor], autocast: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in data:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, gathered from shards (FSDP2 DTensors) where there are any."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def wrap(engine: str, model: nn.Module) -> nn.Module:
    if engine == "ddp":
        return DDP(model)
    from torch.distributed.fsdp import fully_shard
    fully_shard(model)
    return model


def worker(rank: int, init_method: str, engine: str, optimizer: str, autocast: bool) -> None:
    faulthandler.dump_traceback_later(TEST_DEADLINE_S - 20, exit=False)
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback: no dependence on the host name resolving
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    try:
        data = batches(rank)
        reference = small_net()
        candidate = copy.deepcopy(reference)
        if optimizer == "optimize":
            candidate = fxopt.optimize(candidate, (data[0],), memory_budget=0.5)
            assert candidate.fxopt_report["checkpoint_activations"].changed, "the budget checkpointed nothing"
        train(wrap(engine, reference), data, autocast)
        if optimizer == "compile":
            engine_model = wrap(engine, torch.compile(candidate, backend="fxopt"))
        else:
            engine_model = wrap(engine, candidate)
        train(engine_model, data, autocast)
        # DDP's reducer holds the process group: drop it while the other rank is still connected, then
        # meet it, so neither tears gloo down under the other (a gloo destructor left waiting on a rank
        # that had already exited hung a CI run).
        del engine_model
        gc.collect()
        dist.barrier()
        want, got = full_state(reference), full_state(candidate)
        del reference, candidate
        tol = 2e-2 if autocast else 1e-5  # bf16 rounds differently once ops are reordered
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=tol, atol=tol, msg=lambda m, k=k: f"rank {rank} {k}: {m}")
    finally:
        # FSDP2's state (and an fxopt graph) lives in reference cycles, so without this it is freed only while the
        # interpreter shuts down. A worker aborted now and then with "terminate called without an active exception"
        # and no Python frame in any thread, which points there (a shutdown-time abort, the gloo teardown torch's
        # PR 179291 describes); it is collected here instead, while the process group is up.
        gc.collect()
        dist.destroy_process_group()


def run_two_processes(engine: str, optimizer: str, autocast: bool) -> None:
    """Run `worker` on WORLD processes; a process that fails, crashes or outlives the deadline fails the test."""
    context = mp.start_processes(worker, args=(f"tcp://127.0.0.1:{free_port()}", engine, optimizer, autocast),
                                 nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + TEST_DEADLINE_S
    while not context.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {WORLD} processes did not finish within {TEST_DEADLINE_S} s (killed; stacks above)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_engine_around_optimized_model_trains_like_the_original(engine, autocast):
    """DDP / FSDP2 around fxopt.optimize(model, memory_budget=0.5) reach the same parameters as around the model."""
    run_two_processes(engine, "optimize", autocast)


@pytest.mark.slow
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_ddp_compiled_with_fxopt_backend_trains_like_the_original(autocast):
    """DDP(torch.compile(model, backend="fxopt")) with Inductor reaches DDP(model)'s parameters."""
    run_two_processes("ddp", "compile", autocast)

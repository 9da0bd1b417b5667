"""PyTorch's process groups (the NCCL backend) on tensors the cumempool plug-in allocates: one
rank on one GPU, and two ranks on two GPUs where a machine has them. Each run is a fresh process
(a process group is process-wide); what NCCL answered is printed as one JSON line for
docs/distributed.md."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

import cumempool as cm
from conftest import library

RANK = r"""
import json, os, sys
import torch, torch.distributed as dist
import cumempool as cm, cumempool.torch as cmt

rank, world, store = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.cuda.set_device(rank)
device = torch.device("cuda", rank)
dist.init_process_group("nccl", init_method="file://" + store, rank=rank, world_size=world, device_id=device)
pool = cm.MemPool(cm.Route.device(rank))
cache = cm.CachingResource(cm.PoolResource(pool))
mem_pool = cmt.mem_pool(cache)
n = 1 << 16
with torch.cuda.use_mem_pool(mem_pool):
    x = torch.arange(n, dtype=torch.float32, device=device) * (rank + 1)
    y = torch.full((n,), float(rank + 7), device=device)
    gathered = torch.empty(world * n, dtype=torch.float32, device=device)
    parts = [torch.empty(n, dtype=torch.float32, device=device) for _ in range(world)]
mine = x.clone()
dist.all_reduce(x)
dist.broadcast(y, src=0)
dist.all_gather_into_tensor(gathered, mine)
dist.all_gather(parts, mine)
torch.cuda.synchronize()
total = sum(range(1, world + 1))
expected = torch.arange(n, dtype=torch.float32, device=device)
report = {"rank": rank, "world": world, "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
report["all_reduce"] = bool(torch.equal(x, expected * total))
report["broadcast"] = bool(torch.all(y == 7.0))
report["all_gather_into_tensor"] = all(bool(torch.equal(gathered[r * n:(r + 1) * n], expected * (r + 1))) for r in range(world))
report["all_gather"] = all(bool(torch.equal(parts[r], expected * (r + 1))) for r in range(world))
report["served_by_the_plug_in_bytes"] = cmt.statistics()["current_bytes"]
backend = dist.group.WORLD._get_backend(device)
try:
    backend.register_mem_pool(mem_pool)
    report["register_mem_pool"] = "accepted"
    dist.all_reduce(x)
    torch.cuda.synchronize()
    report["all_reduce_after_registration"] = bool(torch.equal(x, expected * total * world))
    backend.deregister_mem_pool(mem_pool)
except Exception as error:  # what NCCL or torch answered, reported rather than hidden
    report["register_mem_pool"] = f"{type(error).__name__}: {error}"
dist.destroy_process_group()
del x, y, gathered, parts, mine
torch.cuda.synchronize()
del mem_pool
torch.cuda.empty_cache()
cmt.stop()
print(json.dumps(report))
"""


def _ranks(world: int) -> list:
    """Runs `world` ranks, each in a fresh process on its own GPU; their reports."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory() as directory:
        store = os.path.join(directory, "store")
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", RANK, str(rank), str(world), store],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(world)
        ]
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    for rank, (_, err) in zip(ranks, outputs, strict=True):
        assert rank.returncode == 0, err[-4000:]
    reports = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    for report in reports:
        print(json.dumps(report))
    return reports


def _check(reports: list) -> None:
    for report in reports:
        for collective in ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather"):
            assert report[collective], f"{collective} on rank {report['rank']}: {report}"
        assert report["served_by_the_plug_in_bytes"] > 0, report
        if report["register_mem_pool"] == "accepted":
            assert report["all_reduce_after_registration"], report


def test_a_one_rank_process_group_runs_collectives_on_plug_in_tensors(gpu):
    library("torch")
    _check(_ranks(1))


def test_two_ranks_run_collectives_on_plug_in_tensors(gpu):
    library("torch")
    if cm.Device.count() < 2:
        if os.environ.get("CUMEMPOOL_REQUIRE_TWO_GPUS") == "1":
            pytest.fail("CUMEMPOOL_REQUIRE_TWO_GPUS=1 but one GPU")
        pytest.skip("needs two GPUs")
    _check(_ranks(2))

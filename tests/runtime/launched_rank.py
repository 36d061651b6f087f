"""One rank started by a launcher, not by autopar (tests/runtime/test_launch.py sets SLURM's or
OpenMPI's variables the way srun / mpirun would, or runs it under a real ``mpirun``): the process
group is initialised from them -- by ``autopar.init()`` first, as the quick start does, when the
second argument is "init", else by ``autopar.parallelize`` -- then it trains 3 AdamW steps of a
small GPT under data parallelism next to one process, and prints one JSON line: rank, world size,
local rank and world size, device, the worst loss / gradient error."""
from __future__ import annotations

import copy
import json
import sys
import warnings

import torch
import torch.distributed as dist

import autopar
from autopar import models


def main() -> None:
    warnings.simplefilter("ignore")
    launched = autopar.init(timeout=120) if sys.argv[2:] == ["init"] else None
    model, inputs = models.build("gpt", layers=2, batch=4)
    ref = copy.deepcopy(model)
    world = int(sys.argv[1])
    pm = autopar.parallelize(model, autopar.Mesh((world,)), inputs, force=autopar.Layout(dp=world), timeout=120)
    # eps 1e-3 (parallel_harness.ADAM_EPS): Adam's default would turn the rounding noise of a gradient
    # that is zero in exact arithmetic into full-size steps in both runs alike
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-3) for m in (pm, ref))
    worst = 0.0
    for _ in range(3):
        loss, want = pm(*inputs), ref(*inputs)
        loss.backward()
        want.backward()
        worst = max(worst, abs(loss.item() - want.item()) / abs(want.item()))
        scale = max(p.grad.abs().max().item() for p in ref.parameters())  # errors against the largest gradient
        for name, g in pm.full_grads().items():
            worst = max(worst, (g - ref.get_parameter(name).grad).abs().max().item() / scale)
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    print(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "worst": worst,
                      "families": pm.plan.summary()["families"],
                      "launched": None if launched is None else
                      {"rank": launched.rank, "world_size": launched.world_size, "local_rank": launched.local_rank,
                       "local_world_size": launched.local_world_size, "device": str(launched.device),
                       "backend": launched.backend}}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

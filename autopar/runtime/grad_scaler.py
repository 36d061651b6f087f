"""``autopar.GradScaler``: dynamic loss scaling for ``precision="fp16"``, agreed on every rank.

torch's ``GradScaler`` checks the gradients a process holds for infs and NaNs and skips the step
where it finds one. A parallelized module's gradients are shards: one rank may overflow where its
peers do not, and their steps, scales and so their parameters would part. This scaler is torch's
(the same scale growth and backoff, ``state_dict()``, ``unscale_`` for clipping), with the overflow
flag made the maximum over every rank (as FSDP's ``ShardedGradScaler`` does) before the step
reads it, so every rank steps or skips alike and keeps the same scale. A collective: call
``step`` (and ``unscale_``) on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose skip decision is every rank's (module docstring). ``group``:
    the ranks that share the step (default: the world)."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True, *, group=None):
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)
        self._group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._enabled:
            return
        super().unscale_(optimizer)
        found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        if not found:  # a rank without gradients still takes part (and step() needs a record)
            found[self._scale.device] = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        flag = torch.stack([v.to(self._scale.device, torch.float32) for v in found.values()]).amax().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        for v in found.values():
            v.copy_(flag.reshape(()).to(v.device))

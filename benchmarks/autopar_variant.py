"""autopar's plans as benchmark variants, with the interface of hand_tuned.HandVariant.

    v = AutoparVariant.builtin("gpt", model_kw, Mesh((2, 2)), layout=Layout(dp=2, tp=2))   # inside each rank
    v = AutoparVariant(model, (), {"input_ids": ids, "labels": ids}, Mesh((4,)))          # any model and call
    v.step(); v.predicted_s; v.describe(); v.close()

The module is ``autopar.parallelize`` of the same seeded model on the same global batch (every rank
passes the full batch; each keeps its slice), trained with the user's own ``torch.optim.AdamW``
over ``pmodel.parameters()`` with ``pmodel.train_step`` (pipelined plans too); ``predicted_s`` is
the plan's predicted step time.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import hand_tuned as ht


class AutoparVariant:
    def __init__(self, model, args: tuple, kwargs: dict, mesh, *, layout=None, pipeline=False, options=None,
                 lr: float = ht.LR):
        import autopar

        self.args, self.kwargs = tuple(args), dict(kwargs)
        self.pm = autopar.parallelize(model, mesh, self.args, example_kwargs=self.kwargs or None, force=layout,
                                      pipeline=pipeline, **(options or {}))
        self.plan = self.pm.plan
        self.precision = self.plan.precision  # None: the model's own dtypes
        self.predicted_s = self.plan.predicted["step_time_s"]
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=lr)

    @classmethod
    def builtin(cls, model_name: str, model_kw: dict, mesh, **kw) -> "AutoparVariant":
        """The built-in ``model_name`` (``autopar.models.build``), called with (inputs, targets)."""
        from autopar import models

        model, inputs = models.build(model_name, **model_kw)
        return cls(model, inputs, {}, mesh, **kw)

    def forward_backward(self) -> float:
        return self.pm.train_step(*self.args, **self.kwargs).item()

    def describe(self) -> str:
        """The plan in one line: degrees, parameter storage, stages."""
        s = self.plan.summary()
        deg = f"tp {s.get('tp')} x pp {s.get('pp')} x dp {s.get('dp')}"
        storage = ", ".join(f"{k} x{v}" for k, v in sorted(s.get("param_storage", {}).items(), key=lambda kv: -kv[1]))
        pipe = s.get("pipeline")
        if pipe and len(pipe["stages"]) > 1:
            layers = [st["layers"][1] - st["layers"][0] + 1 for st in pipe["stages"]]
            deg += (f", {len(pipe['stages'])} stages of {layers} layers on {[st['mesh_shape'] for st in pipe['stages']]}, "
                    f"{pipe['schedule']}, {pipe['microbatches']} microbatches")
        return f"{deg}; parameters {storage}"

    def full_grads(self) -> dict[str, torch.Tensor]:
        grads = self.pm.full_grads()
        return {k: g for k, g in grads.items() if g is not None} if dist.get_rank() == 0 else {}

    def optimizer_step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def step(self) -> float:
        loss = self.forward_backward()
        self.optimizer_step()
        return loss

    def resident_bytes(self) -> int:
        tensors = list(self.pm.parameters()) + list(self.pm.buffers())
        tensors += [p.grad for p in self.pm.parameters() if p.grad is not None]
        tensors += [t for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(seen.values())

    def close(self) -> None:
        for attr in ("pm", "opt", "plan"):
            if hasattr(self, attr):
                delattr(self, attr)

"""What one training step runs, as the planner decides it and codegen and the runtime run it: the
gradient buckets (``buckets``) and how each bucket's gradients are synchronised (``grad_sync``), the
parameters gathered together (``gathers``), where gradients come out whole or pending (``gradients``)
and the pipeline schedules (``schedules``). Nothing here prices anything: ``autopar.cost_model``
prices what these describe, and codegen and the runtime read them without importing the cost
model."""

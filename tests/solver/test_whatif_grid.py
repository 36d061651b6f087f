"""No hand-written configuration beats autopar's plan by autopar's own prices: every tp x pp x dp x
ZeRO x microbatches x vocabulary-parallel configuration of the mesh (``compare.config_grid``),
priced by the same cost model (``autopar.compare``), is predicted no faster than the plan, or does
not fit. (GPT-3 175B on 1024 devices: ``benchmarks/whatif_grid.py``, in ``make bench``.)"""
import pytest

import autopar
from autopar import models
from autopar.solver.compare import compare, config_grid

CASES = [
    # the bench GPT's width and vocabulary on A100s: where whole-layer ZeRO-3 wins by 1.3%, which an
    # ILP pricing each gather's latency apart from its layer's call missed
    ("gpt", dict(vocab=8192, width=256, layers=2, heads=8, seq=128, batch=16), "a100-80g"),
    ("llama", dict(vocab=512, width=64, layers=2, heads=4, kv_heads=2, hidden=176, seq=32, batch=8), "cpu-gloo"),
]


@pytest.mark.parametrize("name, shape, cluster", CASES)
def test_no_configuration_of_the_grid_beats_the_plan(name, shape, cluster):
    model, inputs = models.build(name, device="meta", **shape)
    mesh = autopar.Mesh((4,), cluster=cluster)
    plan = autopar.plan(model, mesh, inputs)
    configs = config_grid(4, layers=shape["layers"], batch=shape["batch"])
    assert len(configs) >= 20
    rows = compare(model, mesh, inputs, configs)
    priced = [r for r in rows if r.step_time_s is not None]
    assert len(priced) >= len(configs) - 2, [r.note for r in rows if r.step_time_s is None]
    best = plan.predicted["step_time_s"]
    beaten = [(r.name, r.step_time_s / best) for r in priced if r.fits and r.step_time_s < best * (1 - 1e-9)]
    assert not beaten, beaten

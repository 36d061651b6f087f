"""Errors that name their cause, in numbers, as a user meets them (typed, one line of what to do)."""
from __future__ import annotations

import pytest
import torch

import autopar
from autopar import models
from autopar.errors import ConfigError


@pytest.fixture(scope="module")
def gpt2():
    import transformers

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg)


def test_a_batch_the_data_parallel_degree_does_not_divide():
    model, inputs = models.build("gpt", layers=2, batch=6)
    with pytest.raises(ConfigError, match=r"its batch of 6 does not divide by dp=4: use a batch that does \(e\.g\. 8\)"):
        autopar.plan(model, autopar.Mesh((4,)), inputs, force=autopar.Layout(dp=4), pipeline=False)


def test_a_stage_count_the_mesh_rows_do_not_divide_into():
    model, inputs = models.build("gpt", layers=2)
    with pytest.raises(ConfigError, match=r"Pipeline\(stages=3\) cuts the mesh's first axis \(4 rows\) into 3 equal "
                                          r"stages.*use stages in \[1, 2, 4\]"):
        autopar.plan(model, autopar.Mesh((4,)), inputs, pipeline=autopar.Pipeline(stages=3))


def test_a_sequence_longer_than_the_models_positions(gpt2):
    ids = torch.randint(0, 64, (2, 32))
    with pytest.raises(ConfigError, match="transformer.wpe looks up row 31 of a table of 16 rows: positions the model "
                                          "counts itself: the sequence is longer than its 16 positions"):
        autopar.plan(gpt2, autopar.Mesh((2,)), example_kwargs={"input_ids": ids, "labels": ids}, pipeline=False)


def test_a_token_id_past_the_vocabulary(gpt2):
    ids = torch.randint(0, 64, (2, 16))
    ids[1, 3] = 70
    with pytest.raises(ConfigError, match="transformer.wte looks up row 70 of a table of 64 rows: an id in input_ids"):
        autopar.plan(gpt2, autopar.Mesh((2,)), example_kwargs={"input_ids": ids, "labels": ids}, pipeline=False)


def test_plan_takes_a_cluster_as_parallelize_does():
    model, inputs = models.build("gpt", layers=1)
    plan = autopar.plan(model, autopar.Mesh((2,)), inputs, cluster="a100-80g", pipeline=False)
    assert plan.mesh["cluster"]["name"] == "a100-80g"


def test_a_model_that_does_not_trace_says_where_without_torchs_graph_dump(capfd):
    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            if h.sum() > 0:  # data-dependent control flow
                return h.sum()
            return -h.sum()

    with pytest.raises(autopar.TraceError, match=r"if h.sum\(\) > 0") as err:
        autopar.plan(Branchy(), autopar.Mesh((2,)), (torch.randn(4, 4),))
    assert "torch.where / torch.cond" in str(err.value)
    assert "def forward" not in capfd.readouterr().err  # torch's partial graph is not printed

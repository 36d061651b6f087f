"""Traced graphs shared by the ir tests; each model is built and traced once per session."""
from __future__ import annotations

import pytest
import torch

import autopar.models
from autopar.ir import trace

N_LAYERS = 3


@pytest.fixture(scope="session")
def gpt():
    model, inputs = autopar.models.build("gpt", layers=N_LAYERS)
    return model, inputs, trace(model, inputs)


@pytest.fixture(scope="session")
def llama():
    model, inputs = autopar.models.build("llama", layers=N_LAYERS)
    return model, inputs, trace(model, inputs)


@pytest.fixture(scope="session")
def mlp():
    model, inputs = autopar.models.build("mlp", layers=N_LAYERS)
    return model, inputs, trace(model, inputs)


def _hf_inputs(vocab: int):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    labels = torch.randint(0, vocab, (2, 16), generator=gen)  # a distinct tensor: export merges aliased inputs
    return (ids,), {"labels": labels}


@pytest.fixture(scope="session")
def hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(
        n_layer=N_LAYERS, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
        bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args, kwargs = _hf_inputs(128)
    return model, (args, kwargs), trace(model, args, kwargs)


@pytest.fixture(scope="session")
def hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        num_hidden_layers=N_LAYERS, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, use_cache=False, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    args, kwargs = _hf_inputs(128)
    return model, (args, kwargs), trace(model, args, kwargs)


ALL_GRAPHS = ["gpt", "llama", "mlp", "hf_gpt2", "hf_llama"]


@pytest.fixture(params=ALL_GRAPHS)
def any_traced(request):
    """(model, inputs, graph) for each of the traced models."""
    return request.getfixturevalue(request.param)

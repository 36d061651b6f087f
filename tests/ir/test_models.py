"""The built-in models (kept with the ir tests that trace them)."""
from __future__ import annotations

import pytest
import torch

import autopar.models
from autopar.errors import ConfigError


@pytest.mark.parametrize("name", ["mlp", "gpt", "llama"])
def test_build_returns_model_and_inputs_with_targets(name):
    model, inputs = autopar.models.build(name)
    assert isinstance(inputs, tuple) and len(inputs) == 2
    loss = model(*inputs)
    assert loss.shape == () and torch.isfinite(loss)
    out = model(inputs[0])
    if name == "mlp":
        assert out.shape == inputs[1].shape
    else:
        cfg = model.config
        assert out.shape == (cfg.batch, cfg.seq, cfg.vocab)
        assert abs(loss.item() - torch.log(torch.tensor(float(cfg.vocab))).item()) < 0.5  # near-uniform at init


def test_gpt_defaults_and_tied_head():
    model, (idx, targets) = autopar.models.build("gpt")
    cfg = model.config
    assert (cfg.layers, cfg.width, cfg.heads, cfg.seq, cfg.vocab, cfg.batch, cfg.dropout) == (2, 64, 4, 32, 256, 4, 0.0)
    assert idx.shape == targets.shape == (4, 32) and idx.dtype == torch.int64
    assert model.lm_head.weight is model.transformer.wte.weight


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_bench_size_is_about_10m(name):
    model, _ = autopar.models.build(name, size="bench", device="meta")
    assert 8e6 < sum(p.numel() for p in model.parameters()) < 12e6


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_causal(name):
    model, (idx, _) = autopar.models.build(name)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % model.config.vocab
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6) and not torch.allclose(a[:, -1], b[:, -1])


def test_llama_structure():
    model, _ = autopar.models.build("llama", width=64, heads=4, kv_heads=1)
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.out_features == 16 and attn.q_proj.out_features == 64
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert "model.rope_cos" not in model.state_dict()  # precomputed, not saved
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(2, 3, 64)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.eps) * norm.weight
    assert torch.allclose(norm(x), ref, atol=1e-5)


def test_mlp_shapes_and_loss():
    model, (x, y) = autopar.models.build("mlp", layers=3, width=5, hidden=7, batch=6)
    assert x.shape == y.shape == (6, 5) and len(model.layers) == 3
    assert torch.allclose(model(x, y), torch.nn.functional.mse_loss(model(x), y))


def test_meta_dtype_seed():
    model, inputs = autopar.models.build("gpt", device="meta", dtype=torch.bfloat16)
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(t.is_meta and t.dtype == torch.int64 for t in inputs)
    _, (x, _) = autopar.models.build("mlp", dtype=torch.float64)
    assert x.dtype == torch.float64
    state = torch.random.get_rng_state()
    a, _ = autopar.models.build("llama", seed=3)
    b, _ = autopar.models.build("llama", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is untouched
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize(
    "name, overrides, words",
    [
        ("gpt", dict(width=65), ["width(65)", "heads(4)"]),
        ("gpt", dict(layers=0), ["layers", "positive"]),
        ("gpt", dict(dropout=1.5), ["dropout"]),
        ("gpt", dict(depth=3), ["depth", "valid options"]),
        ("gpt", dict(size="huge"), ["huge", "bench"]),
        ("llama", dict(heads=4, kv_heads=3), ["heads(4)", "kv_heads(3)"]),
        ("mlp", dict(hidden=-1), ["hidden"]),
        ("bert", {}, ["bert", "gpt"]),
    ],
)
def test_config_errors(name, overrides, words):
    with pytest.raises(ConfigError) as info:
        autopar.models.build(name, **overrides)
    for word in words:
        assert word in str(info.value)


# published parameter counts (papers / model cards), in billions
PUBLISHED_PARAMS = {"gpt2-xl": 1.56, "gpt3-175b": 175.0, "llama2-7b": 6.74, "llama3-8b": 8.03, "llama3-70b": 70.6,
                    "llama3-405b": 405.9}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_published_shapes_by_name(name):
    """Built on the meta device in bfloat16 by default, with the published parameter count (within
    1%) and a training-run batch."""
    model, inputs = autopar.models.build(name)
    p = next(model.parameters())
    assert p.is_meta and p.dtype == torch.bfloat16 and all(t.is_meta for t in inputs)
    billions = sum(t.numel() for t in model.parameters()) / 1e9
    assert abs(billions - PUBLISHED_PARAMS[name]) <= 0.01 * PUBLISHED_PARAMS[name]
    assert inputs[0].shape[0] >= 512
    assert name in autopar.models.names()
    small = autopar.models.config(name, layers=2)
    assert small.layers == 2 and small.width == autopar.models.config(name).width

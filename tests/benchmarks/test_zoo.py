"""The zoo benchmark's checks (benchmarks/zoo.py) say exact only when a variant is: its causal loss is
transformers' own, and ``judge`` refuses a gradient off by more than its allowance (1e-5 of the
tensor's largest entry, or 10x the reference's own float32 rounding where the gradient is zero in
exact arithmetic), a missing or reshaped gradient and losses that drift."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import zoo  # noqa: E402


def test_the_causal_loss_is_transformers_own():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    out = model(input_ids=ids, labels=labels)
    assert zoo.causal_loss(out.logits, labels).item() == pytest.approx(out.loss.item(), rel=1e-6)


def _ref():
    grads = {"w": torch.tensor([1.0, -2.0, 0.5]), "k_bias": torch.tensor([1e-9, -2e-9])}
    return {"grads": grads, "noise": {"w": 1e-8, "k_bias": 1e-9}, "losses": [2.0, 1.9, 1.8]}


def test_judge_passes_what_is_within_its_allowance():
    ref = _ref()
    grads = {"w": ref["grads"]["w"] + 1e-5, "k_bias": torch.tensor([5e-9, 3e-9])}  # the bias: rounding noise
    verdict = zoo.judge(grads, [2.0, 1.9 * (1 + 5e-6), 1.8], ref)
    assert verdict["exact"], verdict
    assert 0 < verdict["grad_allowance_used"] <= 1


@pytest.mark.parametrize("change, words", [
    (lambda g: g.update(w=g["w"] * (1 + 1e-3)), "gradient of w"),
    (lambda g: g.pop("k_bias"), "no gradient of k_bias"),
    (lambda g: g.update(w=g["w"][:2]), "w has shape (2,)"),
])
def test_judge_names_what_is_wrong(change, words):
    ref = _ref()
    grads = {k: v.clone() for k, v in ref["grads"].items()}
    change(grads)
    verdict = zoo.judge(grads, ref["losses"], ref)
    assert not verdict["exact"] and words in verdict["error"], verdict


def test_judge_refuses_drifting_losses():
    ref = _ref()
    verdict = zoo.judge(dict(ref["grads"]), [2.0, 1.9, 1.8 * (1 + 1e-3)], ref)
    assert not verdict["exact"] and "losses" in verdict["error"]

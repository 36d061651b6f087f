"""What a user writes first, with every option at its default: transformers GPT-2, LLaMA, T5 and
Mixtral (a mixture of experts) built from configs as people build them (generation cache on,
``return_dict``), ``autopar.parallelize(model, mesh, example_kwargs=batch)`` on (4,) and (2, 2)
meshes priced with a live profile of the ranks (as users get it), then the plain loop: forward,
``backward()``, torch's clipping, an AdamW step, for 3 steps, a smaller batch, and ``eval()`` without
gradients, next to one process. Whatever the default picked (one stage, a pipeline, idle axes) must
be exact; autopar's own code raises no warning on the way. Ranks given different inputs get one
typed error naming them, on every rank."""
from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

import autopar
from autopar.errors import ConfigError
from autopar.runtime.launch import spawn
from parallel_harness import ADAM_EPS, TOL, TRAINED_STATE_TOL, exact_training, rel, run_case, within_noise

pytestmark = pytest.mark.multirank

AUTOPAR_DIR = str(Path(autopar.__file__).resolve().parent)
VOCAB = 128


def build(arch: str):
    """A small model of each family, from its config class's defaults but for sizes and dropout
    (dropout draws differently on several ranks than on one; exactness needs it off)."""
    import transformers as tf

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    if arch == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        return tf.LlamaForCausalLM(cfg)
    if arch == "t5":
        cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0)
        return tf.T5ForConditionalGeneration(cfg)
    cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=32)
    return tf.MixtralForCausalLM(cfg)


ARCHS = ("gpt2", "llama", "t5", "mixtral")
SHAPES = ((4,), (2, 2))


def batch_of(rows: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (rows, 16), generator=g)
    return {"input_ids": ids, "labels": torch.roll(ids, -1, 1)}


def first_contact(tag, arch, mesh):
    def go():
        model = build(arch)
        ref = copy.deepcopy(model)
        initial = copy.deepcopy(model)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            pm = autopar.parallelize(model, mesh, example_kwargs=batch_of(8, 0))
            err = loop(pm, ref, initial)
        ours = [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if w.filename.startswith(AUTOPAR_DIR)]
        plan = pm.plan
        return {"tag": tag, **err, "warnings": ours, "layout": plan.explain().splitlines()[2],
                "pipeline": plan.pipeline is not None, "cache_note": any("use_cache=False" in n
                                                                          for n in plan.solver["call"]["notes"])}

    return run_case(tag, go)


def loop(pm, ref, initial) -> dict:
    """3 steps of the plain loop on batches of 8, one on a batch of 4, then eval on 8. The trained
    state is compared as ``parallel_harness`` compares it (against the reference's own rounding
    where a parameter's gradient is zero in exact arithmetic)."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2, eps=ADAM_EPS)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=ADAM_EPS)
    err = {"loss": 0.0, "grad": 0.0, "norm": 0.0}
    for step, rows in enumerate((8, 8, 8, 4)):
        batch = batch_of(rows, step)
        out, want = pm(**batch), ref(**batch)
        out.loss.backward()
        want.loss.backward()
        err["loss"] = max(err["loss"], rel(out.loss, want.loss))
        scale = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
        for fqn, g in pm.full_grads().items():
            r = ref.get_parameter(fqn).grad
            if (g is None) != (r is None):
                err["grad"] = float("inf")
            elif g is not None:
                err["grad"] = max(err["grad"], (g - r).abs().max().item() / scale)
        err["norm"] = max(err["norm"], rel(torch.nn.utils.clip_grad_norm_(pm.parameters(), 1.0),
                                           torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
    pm.eval()
    ref.eval()
    with torch.no_grad():
        batch = batch_of(8, 9)
        err["eval"] = rel(pm(**batch).loss, ref(**batch).loss)
    full, want = pm.full_state_dict(), ref.state_dict()
    errs = {k: rel(full[k], v) for k, v in want.items() if k in full}
    noisy = [k for k, e in errs.items() if not e <= TRAINED_STATE_TOL]
    if noisy:
        batches = [batch_of(rows, step) for step, rows in enumerate((8, 8, 8, 4))]
        truth = exact_training(initial, batches, lambda m, x: m(**x).loss, 1e-2, clip=1.0)
        errs.update({k: within_noise(full[k], want[k], truth[k], TRAINED_STATE_TOL) for k in noisy})
    err["state"] = max(errs.values())
    return err


def different_inputs(tag, mesh):
    """Rank 2 passes a batch of another size: every rank raises one ConfigError naming it."""
    def go():
        import torch.distributed as dist

        model = build("gpt2")
        rows = 4 if dist.get_rank() == 2 else 8
        try:
            autopar.parallelize(model, mesh, example_kwargs=batch_of(rows, 0))
            return {"tag": tag, "raised": None}
        except ConfigError as e:
            return {"tag": tag, "raised": str(e)}

    return run_case(tag, go)


def rank_4(rank, world):
    out = []
    for shape in SHAPES:
        mesh = autopar.Mesh(shape)
        out += [first_contact(f"{arch} {shape}", arch, mesh) for arch in ARCHS]
    out.append(different_inputs("different inputs", autopar.Mesh((4,))))
    return out


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # a fresh profile cache: the live profile runs as a user's first would
        mp.setenv("AUTOPAR_CACHE_DIR", str(tmp_path_factory.mktemp("autopar-cache")))
        per_rank = spawn(rank_4, 4, timeout_s=1500)
    return {r["tag"]: [per_rank[k][i] for k in range(4)] for i, r in enumerate(per_rank[0])}


@pytest.mark.parametrize("arch,shape", [(a, str(s)) for s in SHAPES for a in ARCHS])
def test_the_default_trains_exactly_in_the_plain_loop(four_ranks, arch, shape):
    for r in four_ranks[f"{arch} {shape}"]:
        assert "error" not in r, r.get("error")
        assert r["loss"] <= TOL and r["grad"] <= TOL and r["norm"] <= TOL and r["eval"] <= TOL, r
        assert r["state"] <= TRAINED_STATE_TOL, r
        assert r["warnings"] == [], r["warnings"]
        assert r["cache_note"], r  # the default config's cache was switched off for the trace, and said


def test_different_inputs_are_one_typed_error_on_every_rank(four_ranks):
    for r in four_ranks["different inputs"]:
        assert r.get("raised"), r
        assert "different inputs" in r["raised"] and "rank 2: input_ids int64[4, 16]" in r["raised"], r["raised"]

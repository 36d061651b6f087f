"""Strategy families are typed: a label equal to its string, asked about by part."""
import json
import pickle

from autopar.sharding_spec.strategy import (LOWERED_FAMILIES, MEAN_PARTIAL, MEAN_SPLIT, RING_CAUSAL, VOCAB_EMBEDDING,
                                            VOCAB_LOSS, Family, Strategy, needs_lowering)
from autopar.solver.plan import NodePlan, ParamPlan


def test_parts_and_label():
    f = Family.of("dp", "1d-col")
    assert f == "dp+1d-col" and f.parts == ("dp", "1d-col") and hash(f) == hash("dp+1d-col")
    assert Family.of() == "replicate" and Family.of("", "heads") == "heads"
    assert f.has("dp") and not f.has("1d") and not f.has("col")  # parts, never substrings
    assert Family("dp+heads+ring(causal)").ring == RING_CAUSAL and Family("dp+heads+sp").ring is None


def test_questions_by_part():
    assert Family.of("dp", VOCAB_EMBEDDING).vocab_parallel and Family.of(VOCAB_LOSS).vocab_parallel
    assert not Family.of("embedding-hidden").vocab_parallel
    assert Family.of("sharded", "zero2").zero2 and Family("zero2").zero2 and not Family("sharded").zero2
    assert Family.of(MEAN_SPLIT).takes_mean and Family.of("dp", MEAN_PARTIAL).takes_mean
    assert not Family("reduce-partial").takes_mean
    for part in LOWERED_FAMILIES:
        assert needs_lowering(Family.of("dp", part)) and Family.of("dp", part).lowered == {part}
    assert not needs_lowering("dp+1d-row") and not needs_lowering("reduce-partial")


def test_kept_typed_through_strategies_plans_and_files():
    s = Strategy((), None, "dp+1d-row")
    assert type(s.family) is Family and s.family.has("1d-row")
    node = NodePlan("mm", "aten.mm.default", None, "dp+2d", [], None, 0.0, 0.0)
    param = ParamPlan("w", "p_w", None, "sharded+zero2", None, 0.0)
    assert type(node.family) is Family and param.family.zero2
    back = json.loads(json.dumps({"family": node.family}))["family"]
    assert back == "dp+2d" and NodePlan("mm", "aten.mm.default", None, back, [], None, 0.0, 0.0).family.has("2d")
    assert pickle.loads(pickle.dumps(node.family)).parts == ("dp", "2d")

"""What the reducer's pool keeps for ZeRO-2 (``runtime.reducer._Pool``, capped by
``record.buckets.zero2_pool_cap``) as the memory model prices it: whole buckets' buffers, at most
the buckets in use at once and half the gradient bytes ZeRO-2 frees."""
import pytest

from autopar.cost_model.grad_sync import zero2_pool_bytes, zero2_pool_kept
from autopar.record.buckets import DEFAULT_BUCKET_BYTES, zero2_pool_cap, zero2_saved_bytes

MiB = 1 << 20


def test_a_model_whose_one_bucket_outgrows_the_cap_keeps_nothing():
    z = 32 * MiB  # one bucket's worth and a bit: half of what 4 ranks free is 12 MiB
    saved = zero2_saved_bytes([(z, 4)])
    assert saved == 24 * MiB and zero2_pool_cap("reduce_scatter", saved) == 12 * MiB
    assert zero2_pool_kept("reduce_scatter", z, saved) == 0.0
    assert zero2_pool_bytes(MiB, "reduce_scatter", z, saved) == 0.0


@pytest.mark.parametrize("kind, buffers", [("reduce_scatter", 1), ("all_reduce", 1), ("all_to_all", 2)])
def test_a_large_model_keeps_the_buckets_in_use(kind, buffers):
    z = 4096 * MiB
    saved = zero2_saved_bytes([(z, 8)])
    kept = zero2_pool_kept(kind, z, saved)
    assert kept == buffers * 3 * DEFAULT_BUCKET_BYTES  # two in flight and one filling, whole
    # each gradient pays its share of what is kept
    assert zero2_pool_bytes(64 * MiB, kind, z, saved) == pytest.approx(kept * 64 / 4096)


def test_whole_buffers_only():
    z, bucket = 400 * MiB, 25 * MiB
    saved = 2 * bucket + 10 * MiB  # half of it holds one bucket's buffer and 5 MiB
    assert zero2_pool_cap("reduce_scatter", saved) == bucket + 5 * MiB
    assert zero2_pool_kept("reduce_scatter", z, saved) == bucket

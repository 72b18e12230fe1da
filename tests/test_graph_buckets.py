"""Graph buckets on the CPU: which captured (batch, verify nodes) graph serves a step, and the default batch
sizes (the GPU tests capture them; the choice itself is plain arithmetic)."""

import pytest

from k26.graphs.buckets import Bucket, default_batches, pick_bucket


def test_a_step_goes_to_the_smallest_bucket_that_holds_it():
    buckets = [Bucket(1, 16), Bucket(2, 8), Bucket(4, 4), Bucket(4, 16), Bucket(8, 1)]
    assert pick_bucket(buckets, 1, 1) == Bucket(8, 1)  # 8 x 1 rows beat 1 x 16
    assert pick_bucket(buckets, 1, 5) == Bucket(1, 16)  # 16 rows as (2, 8): the smaller batch
    assert pick_bucket(buckets, 3, 4) == Bucket(4, 4)
    assert pick_bucket(buckets, 3, 5) == Bucket(4, 16)
    assert pick_bucket([Bucket(2, 8), Bucket(1, 16)], 1, 8) == Bucket(1, 16)  # equal rows: the smaller batch


def test_a_step_no_bucket_holds_is_refused_naming_the_buckets():
    with pytest.raises(
        ValueError,
        match=r"no graph bucket holds batch 3 with 9 verify tokens; buckets are "
        r"\(batch 1, nodes 16\), \(batch 4, nodes 4\)",
    ):
        pick_bucket([Bucket(4, 4), Bucket(1, 16)], 3, 9)


@pytest.mark.parametrize("batch, nodes", [(0, 1), (1, 0), (-2, 4)])
def test_a_bucket_of_no_rows_is_refused(batch, nodes):
    with pytest.raises(ValueError, match="batch and nodes must be >= 1"):
        Bucket(batch, nodes)


@pytest.mark.parametrize(
    "max_batch, sizes", [(1, [1]), (2, [1, 2]), (6, [1, 2, 4, 6]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 9])]
)
def test_default_batches_double_up_to_the_maximum_and_include_it(max_batch, sizes):
    assert default_batches(max_batch) == sizes

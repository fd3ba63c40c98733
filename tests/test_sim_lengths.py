"""Document-length distribution and packing statistics used by the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.data.lengths import LengthSampler, stdlib_document_lengths


def test_stdlib_corpus_is_real_and_heavy_tailed():
    docs = stdlib_document_lengths()
    assert docs.size > 200 and (docs > 0).all()
    assert np.percentile(docs, 99) > 5 * np.median(docs)


@pytest.mark.parametrize("n", [4096, 8192, 32768])
def test_stats_match_explicit_segments(n):
    s = LengthSampler(n, seed=5)
    st = s.stats(100, 50)
    for k in range(50):
        seg = s.segments(100 + k)
        assert seg.sum() == n
        assert st.num_docs[k] == len(seg)
        assert st.sum_sq_len[k] == pytest.approx(float((seg.astype(float) ** 2).sum()))
        assert st.max_len[k] == seg.max()
    assert (st.sum_sq_len <= n * n).all() and (st.sum_sq_len >= n * n / st.num_docs - 1).all()


def test_pure_function_of_index_across_epochs():
    docs = np.array([3000, 500, 9000, 1200, 700])
    s = LengthSampler(4096, seed=1, lengths=docs)
    far = s.epoch_tokens * 3 // 4096 + 2  # several epochs in
    a = s.stats(far - 5, 10)
    b = LengthSampler(4096, seed=1, lengths=docs).stats(far - 5, 10)
    assert np.array_equal(a.sum_sq_len, b.sum_sq_len)
    # Split documents: segments never exceed the document they come from.
    assert a.max_len.max() <= docs.max()
    c = LengthSampler(4096, seed=2, lengths=docs).stats(far - 5, 10)
    assert not np.array_equal(a.sum_sq_len, c.sum_sq_len)
    with pytest.raises(ValueError, match="token_budget"):
        LengthSampler(10)
    with pytest.raises(ValueError, match="positive"):
        LengthSampler(4096, lengths=[5, 0])

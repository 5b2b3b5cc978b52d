"""The drafter that runs any draft head (drafters/head_drafter.py): its per-request state. The
drafter with real heads (chains, trees, KV rollback, the engine's features) is tested with each
head format in tests/heads/."""

from __future__ import annotations

import torch


def test_state_fuses_pending_rows_lazily_and_truncates_them() -> None:
    """Aux rows wait unfused until a draft needs them; truncating drops exactly the rows of the
    positions cut, whether they were fused already or still pending."""
    from tokenleap.drafters.head_drafter import _State

    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    calls: list[int] = []

    def fuse(rows: torch.Tensor) -> torch.Tensor:
        calls.append(rows.shape[0])
        return rows @ w.T

    aux = torch.randn(12, 6, generator=torch.Generator().manual_seed(1))
    st = _State(fuse=fuse)
    for a, b in ((0, 3), (3, 4), (4, 7)):
        st.append_aux(aux[a:b])
        st.feat_tokens.extend(range(a, b))
    assert calls == []  # nothing fused before a draft asks
    torch.testing.assert_close(st.feature_rows(0, 5), aux[:5] @ w.T)
    assert calls == [5] and st.n_fused == 5
    st.truncate(6)  # one pending row (position 6) cut
    st.append_aux(aux[8:10])  # positions 6, 7 get other rows
    st.feat_tokens.extend([8, 9])
    want = torch.cat([aux[:6], aux[8:10]]) @ w.T
    torch.testing.assert_close(st.feature_rows(0, 8), want)
    st.truncate(2)  # into the fused rows: the pending ones go too
    st.append_aux(aux[10:12])
    st.feat_tokens.extend([10, 11])
    torch.testing.assert_close(st.feature_rows(0, 4), torch.cat([aux[:2], aux[10:12]]) @ w.T)
    assert st.pending == []

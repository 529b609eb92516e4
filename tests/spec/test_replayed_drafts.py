"""`replayed_drafts`: the oracle proposes the known tokens from the sequence's position on,
capped before the last token as HF's prompt lookup is; the warm-up mix meets every verify length
1 .. n + 1 and every count of right drafts in it."""

import torch

from replayquant.spec import replayed_drafts


def _ids(prompt_len, m):
    return torch.zeros(1, prompt_len + m, dtype=torch.long)


def test_oracle_drafts_are_the_next_tokens_capped_before_the_last():
    tokens = list(range(100, 110))
    propose = replayed_drafts(tokens, 7, 4, vocab_size=1000)
    assert propose(_ids(7, 0)) == [100, 101, 102, 103]
    assert propose(_ids(7, 5)) == [105, 106, 107, 108]
    assert propose(_ids(7, 7)) == [107, 108]
    assert propose(_ids(7, 9)) == []


def test_mix_meets_every_length_and_acceptance():
    n, tokens = 4, [999] * 200
    propose = replayed_drafts(tokens, 3, n, vocab_size=1000, mix=True)
    seen = set()
    for _ in range(sum(k + 1 for k in range(n + 1)) * 2):
        d = propose(_ids(3, 0))
        right = next((i for i, t in enumerate(d) if t != 999), len(d))
        assert all(t == 0 for t in d[right:])           # wrong ones: 999 + 1 mod 1000
        seen.add((len(d), right))
    assert seen == {(k, j) for k in range(n + 1) for j in range(k + 1)}

"""One counted `generate`: its tokens, its verify rounds, its target forwards and its wall time.

HF's assisted generation (`generate(..., prompt_lookup_num_tokens=N)` or `assistant_model=`)
runs its own loop: per round a candidate generator proposes drafts (`get_candidates`), one target
forward verifies them, the cache is cropped to the accepted ones, and the generator is told how
many matched (`update_candidate_strategy(input_ids, scores, num_matches)`). `counted_rounds`
wraps the candidate generator HF builds for the model (its `_get_candidate_generator`, on the
model object only, for the duration of a `with`) so that each round records (drafts proposed,
drafts accepted) as HF's own acceptance rule decided them; nothing of HF's loop is redone here.
A forward hook on the target counts its forwards and times the first one, which holds the prompt:
the decode rate is taken after it, so that a prompt's prefill does not dilute it.
`counted_rounds(..., propose=)` replaces the built generator's drafts with the caller's (HF's
loop, its acceptance and the cache's crop unchanged): `replayed_drafts` proposes a known token
sequence (the pair's own plain greedy tokens: the oracle drafts, speculation's ceiling), or, for
a warm-up, a mix of right and wrong drafts that meets every verify length and acceptance.

Decoding is greedy, or sampled (`sampling`: HF's temperature, top_p and top_k) from torch's
global generator seeded just before the call, so that two calls with one seed draw the same
random numbers: HF samples through `torch.multinomial` (plain decode one position per step; prompt
lookup every position of a round, keeping the drafts up to the first one it did not sample; an
assistant model through HF's speculative sampling).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch


@dataclasses.dataclass
class Generation:
    """What one `generate` produced and cost."""
    tokens: list[int]                 # the new tokens
    rounds: list[tuple[int, int]]     # (drafts, accepted) per verify round; [] for plain decode
    forwards: int                     # forwards of the target model
    wall_s: float                     # the whole `generate`, prompt included
    decode_s: float                   # after the first forward (which holds the prompt)
    first_tokens: int                 # tokens the first forward gave

    def record(self, reference: list[int], plain: list[int] | None = None) -> dict:
        """A JSON record: counts, times, and agreement (`agreement`) with `reference` (the
        reference pair's tokens) and, where given, with `plain` (its own pair's plain decode)."""
        rec = {"tokens": self.tokens, "generated": len(self.tokens), "forwards": self.forwards,
               "rounds": [list(r) for r in self.rounds], "wall_s": self.wall_s,
               "decode_s": self.decode_s, "decode_tokens": len(self.tokens) - self.first_tokens,
               "agree_ref": list(agreement(self.tokens, reference))}
        if plain is not None:
            rec["agree_plain"] = list(agreement(self.tokens, plain))
        return rec


def agreement(tokens: list[int], reference: list[int]) -> tuple[int, int]:
    """(positions equal before the first divergence, positions equal in all) of `tokens`
    against `reference`, over the reference's length (a missing token counts as unequal)."""
    same = [i < len(tokens) and tokens[i] == t for i, t in enumerate(reference)]
    prefix = same.index(False) if False in same else len(same)
    return prefix, sum(same)


@contextlib.contextmanager
def counted_rounds(model, rounds: list, propose=None):
    """For the `with` block, every candidate generator HF's assisted generation builds for
    `model` appends (drafts, accepted) of each verify round to `rounds`. With `propose`
    (input_ids [1, n] -> a list of draft token ids), its drafts replace the generator's (which
    then proposes nothing: enter assisted generation with `prompt_lookup_num_tokens`)."""
    build = getattr(model, "_get_candidate_generator", None)
    if build is None:
        raise ValueError(f"{type(model).__name__} has no _get_candidate_generator: this version "
                         f"of transformers builds assisted generation's candidates elsewhere, "
                         f"which `replayquant spec` cannot count")

    def counted(*args, **kwargs):
        gen = build(*args, **kwargs)
        get, update = gen.get_candidates, gen.update_candidate_strategy
        drafted = []

        def get_candidates(input_ids, *a, **kw):
            if propose is None:
                candidates, logits = get(input_ids, *a, **kw)
            else:
                drafts = torch.tensor([propose(input_ids)], dtype=input_ids.dtype,
                                      device=input_ids.device).reshape(1, -1)
                candidates, logits = torch.cat([input_ids, drafts], dim=1), None
            drafted.append(int(candidates.shape[1] - input_ids.shape[1]))
            return candidates, logits

        def update_candidate_strategy(input_ids, scores, num_matches):
            rounds.append((drafted.pop(), int(num_matches)))
            return update(input_ids, scores, num_matches)

        gen.get_candidates = get_candidates
        gen.update_candidate_strategy = update_candidate_strategy
        return gen

    model._get_candidate_generator = counted          # this object only, until the block ends
    try:
        yield rounds
    finally:
        del model._get_candidate_generator


def replayed_drafts(tokens: list[int], prompt_len: int, per_round: int, vocab_size: int,
                    mix: bool = False):
    """A `propose` for `counted_rounds`: at a sequence of prompt_len + m tokens, the next
    min(per_round, len(tokens) - m - 1) of `tokens` from position m (the cap of HF's prompt
    lookup: the last token is the verify's own). With `mix`, round r proposes
    k = per_round - r % (per_round + 1) drafts, the first (r // (per_round + 1)) % (k + 1) of them
    from `tokens` and the rest wrong ones (token + 1 mod vocab_size): every verify length 1 ..
    per_round + 1 and every acceptance of it, for a warm-up."""
    state = {"round": 0}

    def propose(input_ids) -> list[int]:
        m = input_ids.shape[1] - prompt_len
        k = max(0, min(per_round, len(tokens) - m - 1))
        drafts = list(tokens[m:m + k])
        if mix:
            r, state["round"] = state["round"], state["round"] + 1
            k = min(k, per_round - r % (per_round + 1))
            right = (r // (per_round + 1)) % (k + 1)
            drafts = drafts[:right] + [(t + 1) % vocab_size for t in drafts[right:k]]
        return drafts

    return propose


def counted_generate(model, ids: torch.Tensor, new_tokens: int, sampling: dict | None = None,
                     seed: int = 0, **speculation) -> Generation:
    """`generate` of exactly `new_tokens` tokens after prompt `ids` [1, n] (no early stop at an
    end-of-sequence token), counted: greedy, or with `sampling` ({temperature, top_p, top_k},
    HF's options) sampled after `torch.manual_seed(seed)`; `speculation` holds HF's options
    (prompt_lookup_num_tokens=N or assistant_model=...), none for plain decode."""
    decoding = {"do_sample": False}
    if sampling:
        decoding = {"do_sample": True, **sampling}
        torch.manual_seed(seed)
    rounds, ends = [], []
    hook = model.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
    try:
        with counted_rounds(model, rounds):
            t0 = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 **decoding, **speculation)
            t1 = time.perf_counter()
    finally:
        hook.remove()
    tokens = out[0, ids.shape[1]:].tolist()
    first = rounds[0][1] + 1 if rounds else 1
    return Generation(tokens=tokens, rounds=rounds, forwards=len(ends), wall_s=t1 - t0,
                      decode_s=t1 - ends[0], first_tokens=min(first, len(tokens)))

"""The sampler's greedy pick and its checks of mask results (numpy on a CPU row) agree with torch's
definitions: argmax of the row with disallowed entries at -inf, ties and NaN to the lowest index."""

import pytest
import torch

from kvql.engine.request import Request, RequestGroup, SamplingParams
from kvql.engine.decode.sampler import forced_token, sample

VOCAB = 64


def request(tokenizer, mask=None, **params) -> Request:
    group = RequestGroup([1, 2, 3], SamplingParams(max_tokens=4, mask=mask, **params), 0)
    return Request(group, 0, tokenizer, "cpu")


def torch_greedy(row: torch.Tensor, allowed: torch.Tensor | None) -> int:
    if allowed is not None:
        row = torch.where(allowed, row, float("-inf"))
    return int(torch.argmax(row))


@pytest.mark.parametrize("seed", range(40))
def test_greedy_pick_equals_torch_argmax_with_ties_and_nan(tokenizer, seed):
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(-3, 4, (VOCAB,), generator=g).float()  # few distinct values: many ties
    if seed % 4 == 0:
        row[torch.randint(0, VOCAB, (2,), generator=g)] = float("nan")
    allowed = None if seed % 3 == 0 else torch.rand(VOCAB, generator=g) < 0.3
    if allowed is not None and not allowed.any():
        allowed[seed % VOCAB] = True
    mask = None if allowed is None else (lambda ids: allowed)
    token, _ = sample(row, request(tokenizer, mask))
    assert token == torch_greedy(row, allowed)


def test_short_mask_is_padded_with_disallowed_tokens(tokenizer):
    row = torch.arange(VOCAB, dtype=torch.float32)  # the best token is the last one
    allowed = torch.zeros(VOCAB - 8, dtype=torch.bool)
    allowed[[3, 10]] = True
    assert sample(row, request(tokenizer, lambda ids: allowed))[0] == 10


@pytest.mark.parametrize("allowed, message", [(torch.zeros(VOCAB, dtype=torch.bool), "allows no token"),
                                              (torch.ones(VOCAB + 1, dtype=torch.bool), "mask has 65 entries")])
def test_bad_mask_results_are_clear_errors(tokenizer, allowed, message):
    with pytest.raises(ValueError, match=message):
        sample(torch.zeros(VOCAB), request(tokenizer, lambda ids: allowed))


def test_masks_of_other_dtypes_mean_nonzero_is_allowed(tokenizer):
    row = torch.arange(VOCAB, dtype=torch.float32)
    allowed = torch.zeros(VOCAB, dtype=torch.int64)
    allowed[5] = 7
    assert sample(row, request(tokenizer, lambda ids: allowed))[0] == 5
    assert forced_token(allowed, VOCAB) == 5
    allowed[9] = 1
    assert forced_token(allowed, VOCAB) is None


def test_greedy_masked_logprobs_are_of_the_masked_row(tokenizer):
    row = torch.arange(VOCAB, dtype=torch.float32)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[1, 2]] = True
    token, entry = sample(row, request(tokenizer, lambda ids: allowed, logprobs=0, masked_logprobs=True))
    assert token == 2
    assert entry.logprob == pytest.approx(float(torch.log_softmax(torch.tensor([1.0, 2.0]), 0)[1]))

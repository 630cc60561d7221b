"""The model runner's attention paths agree with each other and with plain transformers."""

from __future__ import annotations

import functools

import torch

from conftest import random_prompts
from kvql.engine.model import attention_plan, model_runner
from kvql.engine.cache.kv_pool import KVPool
from kvql.engine.model.model_runner import ModelRunner, Segment
from kvql.engine.model.pool_attention import _attention

EMPTY = torch.empty(0, dtype=torch.long)


def runner_for(hf, slots=2048):
    cfg = hf.config
    pool = KVPool(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                  head_dim=cfg.hidden_size // cfg.num_attention_heads, num_slots=slots,
                  dtype=next(hf.parameters()).dtype, device="cpu")
    return ModelRunner(hf, pool), pool


def prefill(runner, pool, prompts):
    segs = [Segment(p, 0, EMPTY, pool.alloc(len(p)), True, all_logits=True) for p in prompts]
    return segs, runner.forward(segs)


def gathering_runner(hf, monkeypatch):
    """A runner on the plan's SDPA path (causal groups, buckets), as on a device without the paged kernel."""
    monkeypatch.setenv("KVQL_PAGED_ATTENTION", "0")
    runner, pool = runner_for(hf)
    assert not runner.paged
    return runner, pool


def test_prompts_without_past_match_plain_transformers(tokenizer, llama, monkeypatch):
    """Ragged prompts (some adjacent with equal lengths: one causal group) computed in place."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14], list(range(20, 29)), [40]]
    runner, pool = gathering_runner(llama, monkeypatch)
    assert [(c.rows, c.q_len) for c in attention_plan.plan(
        [Segment(p, 0, EMPTY, EMPTY, True) for p in prompts], 2, "cpu").causal] == [(2, 5), (1, 9), (1, 1)]
    _, logits = prefill(runner, pool, prompts)
    for p, got in zip(prompts, logits):
        with torch.inference_mode():
            want = llama(input_ids=torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_causal_group_over_scattered_slots_reads_them_by_index(tokenizer, llama, monkeypatch):
    """Prompts whose slots are not consecutive (a pool after evictions) attend over the K/V at those slots."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]]
    runner, pool = gathering_runner(llama, monkeypatch)
    free = pool.alloc(20)
    segs = [Segment(p, 0, EMPTY, free[i::2][:len(p)], True, all_logits=True) for i, p in enumerate(prompts)]
    [group] = attention_plan.plan(segs, 2, "cpu").causal
    assert isinstance(group.slots, torch.Tensor) and group.rows == 2
    for p, got in zip(prompts, runner.forward(segs)):
        with torch.inference_mode():
            want = llama(input_ids=torch.tensor([p])).logits[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_in_place_causal_path_equals_the_gathered_path(tokenizer, llama, monkeypatch):
    prompts = random_prompts(seed=3, count=6, vocab=len(tokenizer))
    runner, pool = gathering_runner(llama, monkeypatch)
    assert any(isinstance(c.slots, slice) for c in attention_plan.plan(
        [Segment(p, 0, EMPTY, pool.alloc(len(p)), True) for p in prompts], 2, "cpu").causal)
    _, in_place = prefill(runner, pool, prompts)
    monkeypatch.setattr(model_runner, "plan", functools.partial(attention_plan.plan, in_place=False))
    _, gathered = prefill(runner, pool, prompts)
    for a, b in zip(in_place, gathered):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_pool_kv_written_in_place_serves_later_decodes(tokenizer, llama, monkeypatch):
    """K/V of an in-place prefill are in the pool: a decode step over them equals the uncached forward."""
    prompts = random_prompts(seed=4, count=5, vocab=len(tokenizer))
    runner, pool = gathering_runner(llama, monkeypatch)
    segs, _ = prefill(runner, pool, prompts)
    step = [Segment([7], len(p), s.new_slots, pool.alloc(1), True) for p, s in zip(prompts, segs)]
    for p, got in zip(prompts, runner.forward(step)):
        with torch.inference_mode():
            want = llama(input_ids=torch.tensor([p + [7]])).logits[0, -1:]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_bf16_attention_rows_do_not_depend_on_batch_mates():
    """Without merging, each request's attention output is bitwise the same in a batch as alone,
    even when its batch mates share its prefix and have other lengths (padding)."""
    torch.manual_seed(0)
    kv_heads, groups, d, slots = 2, 3, 16, 400
    k_pool = torch.randn(1, kv_heads, slots, d).to(torch.bfloat16)
    v_pool = torch.randn(1, kv_heads, slots, d).to(torch.bfloat16)
    prefix = torch.arange(60)
    own = [torch.arange(100 + 25 * i, 101 + 30 * i) for i in range(4)]  # 1, 6, 11, 16 slots
    segs = [Segment([1], 60 + own[i].numel(), torch.cat([prefix, own[i]]), torch.tensor([300 + i]), True)
            for i in range(4)]
    segs.append(Segment([1, 2, 3], 30, torch.arange(200, 230), torch.tensor([310, 311, 312]), True))
    t = sum(len(s.token_ids) for s in segs)
    q = torch.randn(1, kv_heads * groups, t, d).to(torch.bfloat16)

    def attend(indices):
        rows = torch.tensor([sum(len(segs[j].token_ids) for j in range(i)) + r
                             for i in indices for r in range(len(segs[i].token_ids))])
        p = attention_plan.plan([segs[i] for i in indices], groups, "cpu", merge=False)
        out, _ = _attention(None, q[:, :, rows], k_pool, v_pool, None, scaling=0.25, kvql_plan=p)
        return out[0], rows

    batched, _ = attend(range(len(segs)))
    for i in range(len(segs)):
        alone, rows = attend([i])
        assert torch.equal(alone, batched[rows])


def test_batch_invariant_and_merging_attention_agree(tokenizer, llama):
    """Per-request attention (batch-invariant mode) and merged clusters give the same logits (fp32)."""
    prompt = random_prompts(seed=5, count=1, vocab=len(tokenizer), prefix_lengths=(40,))[0]
    runner, pool = runner_for(llama)
    (seg,), _ = prefill(runner, pool, [prompt])
    # four requests share the prompt's slots and add their own tokens: a chunk and decode steps
    own = [prefill(runner, pool, [[9 + i] * (i + 1)])[0][0].new_slots for i in range(4)]
    step = [Segment([3 + i] * (1 + (i == 3) * 4), len(prompt) + i + 1, torch.cat([seg.new_slots, own[i]]),
                    pool.alloc(1 + (i == 3) * 4), True, all_logits=True) for i in range(4)]
    got = {}
    for mode in (False, True):
        runner.batch_invariant = mode
        got[mode] = runner.forward(step)
    for a, b in zip(got[False], got[True]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert [b.rows for b in attention_plan.plan(step, runner.groups, "cpu").buckets] == [1]  # one cluster
    # batch-invariant: one bucket per (queries, keys padded to a KEY_BLOCK multiple): 3 decode rows, 1 chunk
    assert [(b.rows, b.q_len, b.k_len) for b in attention_plan.plan(step, runner.groups, "cpu", merge=False).buckets] \
        == [(3, 1, 64), (1, 5, 64)]


def test_gathers_over_either_pool_axis_agree(tokenizer, llama):
    """The runner gathers a bucket's slots over the pool's slot axis (one thread) or over the pool viewed
    `[kv_heads * slots]` (several threads): the same logits."""
    prompts = random_prompts(seed=6, count=6, vocab=len(tokenizer))
    runner, pool = runner_for(llama)
    segs, _ = prefill(runner, pool, prompts)
    step = [Segment([7], len(p), s.new_slots, pool.alloc(1), True) for p, s in zip(prompts, segs)]
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(runner.forward(step))
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

"""The model's own forward over the pool (admission: `own`; model_runner.ModelRunner._own) and the layers kvql runs
in a form of its own (MLA's latent: what the pool holds per token, kept by the disk tier across a restart), and
the engine's features (n >= 2, speculation, prompt logprobs) give what they give on the ragged path. Exactness
cold / warm / staggered and bf16 batched = alone per family: tests/test_families.py."""

from __future__ import annotations

import pytest
import torch

import families as F
from kvql.engine.cache.memory import MIN_LOAD_TOKENS


def _model(name, tokenizer, **kw):
    import kvql

    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    return hf, kvql.Model(hf, tokenizer, cache_budget=8 << 20, **kw)


def test_mla_caches_its_latent_once_and_the_disk_tier_serves_it_after_a_restart(tokenizer, tmp_path):
    """MLA on the ragged path, absorbed (latent_attention.py): the pool holds per token and layer the latent and
    the rotary key part as one key and no values (what the model's own cache holds, in one row); the disk tier
    writes such a pool and a new model reads it back, exact."""
    hf, a = _model("deepseek_v3", tokenizer, disk_cache=tmp_path, cache_save_interval=0)
    c = hf.config
    assert a.own_forward is None and a.engine.runner.geometry.latent == {0, 1}
    assert a.engine.pool.v.shape[-1] == 0
    assert a.engine.pool.token_bytes == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    ps = F.prompts(len(tokenizer), seed=5)
    want = F.reference("deepseek_v3", F.FAMILIES["deepseek_v3"][1], tokenizer, ps, 6)
    assert [x.token_ids for x in a.generate(ps, max_tokens=6)] == want
    a.close()
    import kvql

    b = kvql.Model(hf, tokenizer, cache_budget=8 << 20, disk_cache=tmp_path, cache_save_interval=0)
    try:
        again = b.generate(ps, max_tokens=6)
        assert [x.token_ids for x in again] == want
        # served from the disk but the last token, or a run on disk too short to read back (computed instead)
        assert all(x.cached_tokens >= x.prompt_tokens - 1 - MIN_LOAD_TOKENS for x in again)
        assert b.stats()["disk_tokens"] > 0
        b.check_integrity()
    finally:
        b.close()


def test_samples_speculation_and_prompt_logprobs_on_the_own_path(tokenizer):
    """StableLM (its attention outside transformers' interface): n = 2 greedy samples each equal the reference,
    speculation on equals off (the warm run drafts from the first run's outputs), prompt logprobs equal those of
    the model's plain forward."""
    _, m = _model("stablelm", tokenizer)
    _, off = _model("stablelm", tokenizer, speculate=False)
    try:
        ps = F.prompts(len(tokenizer), seed=6, count=4)
        want = F.reference("stablelm", F.FAMILIES["stablelm"][1], tokenizer, ps, 8)
        for _ in range(2):
            groups = m.generate(ps, max_tokens=8, n=2)
            assert [[x.token_ids for x in groups[2 * i:2 * i + 2]] for i in range(len(ps))] == [[w, w] for w in want]
        assert [x.token_ids for x in off.generate(ps, max_tokens=8)] == want
        p = ps[3]
        got = m.generate([p], max_tokens=1, prompt_logprobs=0)[0].prompt_logprobs
        with torch.inference_mode():
            logits = off.hf_model(input_ids=torch.tensor([p])).logits[0].float().log_softmax(-1)
        expect = [float(logits[i, p[i + 1]]) for i in range(len(p) - 1)]
        assert [e.logprob for e in got[1:]] == pytest.approx(expect, abs=1e-4)
        m.check_integrity()
    finally:
        m.close()
        off.close()



# -- models with recurrent layers: states carried per request, snapshots serve prefixes ------------------------------

def _reference(name, tokenizer, prompts, max_tokens):
    return F.reference(F.FAMILIES[name][0], F.FAMILIES[name][1], tokenizer, prompts, max_tokens)


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_a_few_shot_prefix_is_served_through_a_snapshot_of_the_recurrent_state(tokenizer, name):
    """A few-shot prefix asked with new questions: the first request computes it all; the second finds the
    prefix's K/V in the tree but no snapshot there, computes it again and leaves one where it diverged; every
    later one resumes from that snapshot (its cached tokens: the shared prefix). Exact throughout."""
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(1, len(tokenizer), (30,), generator=g).tolist()
    prompts = [shared + torch.randint(1, len(tokenizer), (5,), generator=g).tolist() for _ in range(5)]
    want = _reference(name, tokenizer, prompts, 6)
    _, m = _model(name, tokenizer)
    try:
        assert m.engine.runner.geometry.recurrent and m.engine.speculate  # drafts rewind states (test_speculation)
        got = [m.generate([p], max_tokens=6)[0] for p in prompts]
        assert [c.token_ids for c in got] == want
        assert [c.cached_tokens for c in got] == [0, 0, 30, 30, 30]
        again = m.generate([prompts[0]], max_tokens=6)[0]  # the same prompt: all but its last token
        assert again.token_ids == want[0] and again.cached_tokens == len(prompts[0]) - 1
        stats = m.stats()
        assert stats["snapshot_resumes"] == 4 and 0 < stats["snapshot_bytes"] <= stats["snapshot_budget_bytes"]
        m.check_integrity()
        m.clear_cache()
        assert m.stats()["snapshots"] == 0 and m.generate([prompts[1]], max_tokens=6)[0].cached_tokens == 0
    finally:
        m.close()


def test_recurrent_states_through_batches_samples_and_preemption(tokenizer):
    """Concurrent prompts sharing prefixes (a request waiting for another's prefix resumes where they diverge),
    n = 2 greedy samples (each continues a copy of the prompt's state), and a pool small enough to preempt
    (a preempted request resumes from the snapshot taken where it stopped): every sample equals the reference."""
    import kvql

    name = "granitemoehybrid"
    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    ps = F.prompts(len(tokenizer), seed=8, count=6)
    want = _reference(name, tokenizer, ps, 10)
    m = kvql.Model(hf, tokenizer, cache_budget=8 << 20)
    try:
        got = m.generate(ps, max_tokens=10, n=2)
        assert [[c.token_ids for c in got[2 * i:2 * i + 2]] for i in range(len(ps))] == [[w, w] for w in want]
        m.check_integrity()
    finally:
        m.close()
    # a budget of 9 states: 2 for the requests running at once (at most a quarter), 2.25 for snapshots, the pool
    # the rest (~120 tokens: two requests of up to 77 tokens each preempt one another)
    state = m.engine.runner.geometry.state_bytes
    small = kvql.Model(hf, tokenizer, cache_budget=9 * state, max_batch_tokens=16)
    try:
        assert small.engine.scheduler.max_running == 2
        longer = _reference(name, tokenizer, ps, 30)
        assert [c.token_ids for c in small.generate(ps, max_tokens=30)] == longer
        assert small.stats()["preemptions"] > 0
        small.check_integrity()
    finally:
        small.close()


@pytest.mark.parametrize("name", ["qwen3_5", "falcon_h1"])
def test_snapshots_go_to_the_disk_tier_and_serve_prefixes_after_a_restart(tokenizer, tmp_path, name):
    """A model with recurrent layers (Falcon-H1's layers hold K/V and a state) on a disk tier: its snapshots are
    written beside the K/V files at close and read back at the next start, which then serves every prompt from
    the disk but its last token, exact; a snapshots file of another model is a miss, with one warning."""
    import kvql

    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, len(tokenizer), (40,), generator=g).tolist() for _ in range(3)]
    want = _reference(name, tokenizer, prompts, 6)
    a = kvql.Model(hf, tokenizer, cache_budget=8 << 20, disk_cache=tmp_path, cache_save_interval=0)
    assert [c.token_ids for c in a.generate(prompts, max_tokens=6)] == want
    a.close()
    b = kvql.Model(hf, tokenizer, cache_budget=8 << 20, disk_cache=tmp_path, cache_save_interval=0)
    try:
        assert b.stats()["snapshots"] > 0
        again = b.generate(prompts, max_tokens=6)
        assert [c.token_ids for c in again] == want
        assert all(c.cached_tokens == c.prompt_tokens - 1 for c in again) and b.stats()["disk_tokens"] > 0
        b.check_integrity()
    finally:
        b.close()


def test_a_snapshots_file_that_is_not_this_models_is_not_used(tokenizer, tmp_path, caplog):
    import logging

    import kvql
    from kvql.engine.cache.state_snapshots import FILE

    hf = F.build(*F.FAMILIES["lfm2"], len(tokenizer), tokenizer.eos_token_id)
    prompt = F.prompts(len(tokenizer), seed=10, count=1, long=True)[0] * 2
    a = kvql.Model(hf, tokenizer, cache_budget=8 << 20, disk_cache=tmp_path, cache_save_interval=0)
    want = a.generate([prompt], max_tokens=6)[0].token_ids
    path = a.engine.tier.path / FILE
    a.close()
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # a tensor's byte changed: the checksum fails
    path.write_bytes(bytes(raw))
    caplog.set_level(logging.WARNING, logger="kvql.cache")
    b = kvql.Model(hf, tokenizer, cache_budget=8 << 20, disk_cache=tmp_path, cache_save_interval=0)
    try:
        assert b.stats()["snapshots"] == 0 and any(FILE in r.getMessage() for r in caplog.records)
        again = b.generate([prompt], max_tokens=6)[0]
        assert again.token_ids == want and again.cached_tokens == 0  # K/V on disk, but no state to resume from
    finally:
        b.close()


def test_the_snapshots_file_counts_in_the_disk_budget(tokenizer, tmp_path):
    """The tier's bytes are its K/V files' and the snapshots file's; the file holds the most recently used
    snapshots that fit in a quarter of the budget, so a small budget keeps fewer and the tier stays within it."""
    import kvql
    from kvql.engine.cache.state_snapshots import DISK_SHARE, FILE

    hf = F.build(*F.FAMILIES["qwen3_5"], len(tokenizer), tokenizer.eos_token_id)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, len(tokenizer), (40,), generator=g).tolist() for _ in range(4)]
    kept = {}
    for budget in (64 << 20, 96 << 10):
        d = tmp_path / str(budget)
        m = kvql.Model(hf, tokenizer, cache_budget=8 << 20, disk_cache=d, disk_budget=budget, cache_save_interval=0)
        try:
            m.generate(prompts, max_tokens=4)
            m.save_cache()
            tier = m.engine.tier
            side = (tier.path / FILE).stat().st_size if (tier.path / FILE).exists() else 0
            assert tier.side_bytes == side and side <= budget // DISK_SHARE + 4096  # the header beside the states
            assert tier.bytes <= budget
            kept[budget] = side
        finally:
            m.close()
    assert 0 < kept[96 << 10] < kept[64 << 20]


def test_the_running_requests_states_are_counted_in_the_cache_budget(tokenizer):
    """A hybrid's running requests hold a recurrent state each: the engine reserves one for each request that may
    run at once from the cache budget (at most a quarter of it: fewer run at once where a quarter holds fewer),
    beside the snapshots' quarter and the pool; requests past that wait their turn and answer exactly."""
    import kvql

    name = "qwen3_5"
    hf = F.build(*F.FAMILIES[name], len(tokenizer), tokenizer.eos_token_id)
    budget = 96 << 10
    m = kvql.Model(hf, tokenizer, cache_budget=budget)
    try:
        state, running = m.engine.runner.geometry.state_bytes, m.engine.scheduler.max_running
        assert state > 0 and 1 <= running < 6
        stats = m.stats()
        assert stats["running_state_bytes"] == state * running <= budget // 4
        assert stats["running_state_bytes"] + stats["snapshot_budget_bytes"] + m.engine.pool.num_slots * \
            m.engine.pool.token_bytes <= budget
        ps = F.prompts(len(tokenizer), seed=9, count=6)
        assert [c.token_ids for c in m.generate(ps, max_tokens=6)] == _reference(name, tokenizer, ps, 6)
        m.check_integrity()
    finally:
        m.close()

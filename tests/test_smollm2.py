"""Integration: the embedded SmolLM2-135M, kvql vs plain transformers `generate` (fp32, greedy)."""

from __future__ import annotations

import pytest
import torch

import kvql

pytestmark = pytest.mark.smollm2

FEW_SHOT = "".join(f"Q: {q}\nA: {a}\n" for q, a in [
    ("What is the capital of France?", "Paris"), ("How many legs does a dog have?", "Four"),
    ("What color is snow?", "White"), ("What is 2 + 3?", "5"), ("Which planet do we live on?", "Earth")])
QUESTIONS = ["What is the capital of Spain?", "What color is the sun?", "How many wings does a bird have?",
             "What is 4 + 4?", "Which animal says meow?", "What do bees make?"]


@pytest.fixture(scope="module")
def smol():
    m = kvql.model("smollm2-135m", dtype="float32", cache_budget="256MB")  # exact: equals transformers
    yield m
    m.close()


def hf_generate(m, prompt: str, max_tokens: int) -> list[int]:
    ids = torch.tensor([m.tokenizer.encode(prompt)])
    with torch.inference_mode():
        out = m.hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                  do_sample=False, pad_token_id=m.tokenizer.eos_token_id)
    gen = out[0, ids.shape[1]:].tolist()
    eos = m.hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return gen[:next((i for i, t in enumerate(gen) if t in eos), len(gen))]


def test_few_shot_answers_equal_transformers_generate_cold_and_warm(smol):
    prompts = [f"{FEW_SHOT}Q: {q}\nA:" for q in QUESTIONS]
    reference = [hf_generate(smol, p, 8) for p in prompts]
    smol.clear_cache()
    cold = smol.generate(prompts, max_tokens=8)
    warm = smol.generate(prompts, max_tokens=8)
    assert [c.token_ids for c in cold] == reference
    assert [c.token_ids for c in warm] == reference
    assert all(c.cached_tokens == c.prompt_tokens - 1 for c in warm)
    assert sum(c.cached_tokens for c in cold) > 0  # the shared few-shot prefix was computed once
    smol.check_integrity()


def test_stop_at_newline_returns_the_answer_only(smol):
    (c,) = smol.generate([f"{FEW_SHOT}Q: What is the capital of Italy?\nA:"], max_tokens=10, stop="\n")
    assert "\n" not in c.text and c.text.strip()
    assert c.finish_reason == "stop"


def test_a_query_answers_as_plain_generation_does(smol):
    """The few-shot query on the real model: each answer equals uncached transformers greedy text."""
    import kvql

    @kvql.query(model=smol)
    def answer(question):
        '''lmql
        "{FEW_SHOT}Q: {question}\nA:[ANSWER]" where STOPS_BEFORE(ANSWER, "\n") and len(TOKENS(ANSWER)) < 8
        return ANSWER
        '''

    got = answer.map(QUESTIONS[:3])
    for q, a in zip(QUESTIONS[:3], got):
        text = smol.tokenizer.decode(hf_generate(smol, f"{FEW_SHOT}Q: {q}\nA:", 8))
        assert a == text.split("\n")[0]

"""Shared fixtures: a byte-level BPE tokenizer trained in code and tiny random models built from configs."""

from __future__ import annotations

import contextlib
import copy
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

import uvicorn

import kvql
from kvql.server.app import create_app

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is the capital of France? Answer: Paris.",
    "Question: how many legs does a spider have? Answer: eight.",
    "Once upon a time there was a little robot who liked to count tokens.",
    "def add(a, b):\n    return a + b\n",
    "kvql serves every shared prefix from a radix tree of cached keys and values.",
] * 20

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


@pytest.fixture(scope="session")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_model(tokenizer, family: str = "llama", seed: int = 0, **overrides):
    """A random 2-layer model; a large init range makes logits peaked, so greedy ties are rare. `overrides`:
    config fields to set otherwise (sizes, `initializer_range`)."""
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**{**dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                  initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                                  tie_word_embeddings=False), **overrides})
    torch.manual_seed(seed)
    return model_cls(config).eval()


@pytest.fixture(scope="session")
def llama(tokenizer):
    return tiny_model(tokenizer, "llama")


@pytest.fixture
def make_model(tokenizer, llama):
    """`make_model(cache_tokens=..., **kw)` -> a kvql Model over the shared tiny Llama; closed after the test."""
    made = []

    def make(hf_model=None, cache_tokens: int = 4096, **kw):
        hf = hf_model if hf_model is not None else llama
        cfg = hf.config
        per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
        m = kvql.Model(hf, tokenizer, cache_budget=cache_tokens * per_token, **kw)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.fixture
def local(make_model):
    """A fresh tiny model on the local engine, also the default model of queries that name none."""
    model = make_model()
    kvql.set_default_model(model)
    yield model
    kvql.set_default_model(None)


@pytest.fixture
def m(local):
    """The default model of a test (the local engine; query-language test files override `m` with
    `each_backend`, and take `local` where they inspect the engine itself)."""
    return local


@contextlib.contextmanager
def serving(app):
    """Run `app` under uvicorn on a free loopback port in this process; yields the base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(1000):
        if server.started:
            break
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@torch.inference_mode()
def reference_greedy(hf_model, prompt_ids: list[int], max_tokens: int, eos_id: int | None) -> list[int]:
    """Uncached greedy decoding: a full plain transformers forward over the whole sequence per token."""
    ids, out = list(prompt_ids), []
    for _ in range(max_tokens):
        logits = hf_model(input_ids=torch.tensor([ids])).logits[0, -1]
        tok = int(torch.argmax(logits))
        if tok == eos_id:
            break
        out.append(tok)
        ids.append(tok)
    return out


def random_prompts(seed: int, count: int, vocab: int, prefix_lengths=(0, 5, 17, 40), suffix=(1, 12)):
    """Prompts that share prefixes of varied lengths (several families of shared prefixes)."""
    g = torch.Generator().manual_seed(seed)
    bases = [torch.randint(1, vocab, (max(prefix_lengths),), generator=g).tolist() for _ in range(3)]
    prompts = []
    for i in range(count):
        base = bases[i % len(bases)]
        k = prefix_lengths[int(torch.randint(len(prefix_lengths), (1,), generator=g))]
        n = int(torch.randint(suffix[0], suffix[1] + 1, (1,), generator=g))
        prompts.append(base[:k] + torch.randint(1, vocab, (n,), generator=g).tolist())
    return prompts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir, port, *options, budget: str = "4MB", preexec_fn=None):
    """A `kvql serve` subprocess for `model_dir` on `port` (float32, kvql's exact mode, unless `options` say
    otherwise), once its /health answers; `preexec_fn` runs in the child before it starts (limits)."""
    proc = subprocess.Popen([sys.executable, "-m", "kvql.cli", "serve", "--model", str(model_dir), "--port",
                             str(port), "--cache-budget", budget, "--log-level", "warning", "--dtype", "float32",
                             *options],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=preexec_fn)
    if wait_healthy(proc, port):
        return proc
    proc.kill()
    raise AssertionError(f"server did not start: {proc.stdout.read().decode()[-2000:]}")


def wait_healthy(proc, port: int) -> bool:
    """Whether the server process `proc` answers /health on `port` within 60 s (False once it exits)."""
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return True
        except httpx.TransportError:
            time.sleep(0.1)
        if proc.poll() is not None:
            return False
    return False


def save_model(directory, hf_model, tokenizer):
    """`hf_model` and `tokenizer` written to `directory` as a model directory kvql loads; the directory."""
    hf_model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def served_llama(tmp_path_factory, llama, tokenizer):
    """One `kvql serve` subprocess serving the tiny Llama for the whole session: its /v1 URL."""
    model_dir = save_model(tmp_path_factory.mktemp("served") / "model", llama, tokenizer)
    port = free_port()
    proc = start_server(model_dir, port, budget="32MB")
    yield f"http://127.0.0.1:{port}/v1"
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(params=["local", "remote"])
def each_backend(request, make_model, tokenizer):
    """The default model of a test's queries, once per backend: the local engine, and the remote backend
    on a `kvql serve` subprocess serving the same tiny model (prompts sent as token ids)."""
    if request.param == "local":
        model = make_model()
    else:
        model = kvql.model(request.getfixturevalue("served_llama"), tokenizer=tokenizer)
    kvql.set_default_model(model)
    yield model
    kvql.set_default_model(None)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def served(tokenizer, llama):
    """An in-process server of the tiny Llama named "tiny", with CHAT_TEMPLATE, max_tokens capped at 64:
    (its base URL, the model)."""
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = CHAT_TEMPLATE
    model = kvql.Model(llama, tok, name="tiny", cache_budget=4 << 20)
    with serving(create_app(model, max_tokens_cap=64)) as url:
        yield url, model


@pytest.fixture
def client(served):
    """The `openai` client of `served`."""
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="x", max_retries=0)

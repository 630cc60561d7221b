"""Query entry points, named as in LMQL: `query`, `run`, `run_sync`, `F`, `generate`, `score`, ...

`import kvql as lmql` works for ordinary LMQL code. Queries run on kvql's engine: every run of every
query shares one loaded model per spec and its radix KV cache; concurrent runs (asyncio, threads,
`Query.map`) are batched together by the engine.
"""

from __future__ import annotations

import ast
import asyncio
import concurrent.futures
import functools
import inspect
import math
import textwrap
from dataclasses import dataclass

from .backends.local import Model
from .backends.remote import RemoteModel
from .lang.compiler import CompiledQuery, Decoder, compile_query
from .lang.prompt_string import Expr, Hole, parse_prompt
from .runtime import constraints
from .runtime.context import DECODER_OPTIONS, Context, Decoding, QueryError, UnmetConstraint, decoding
from .runtime.result import LMQLResult
from .runtime.scoring import score_continuations

DEFAULT_MODEL = "smollm2-135m"
_models: dict[str, Model] = {}
_default: Model | str | None = None


def set_default_model(model: Model | str) -> None:
    """Model used by queries that name none (default: the embedded SmolLM2-135M)."""
    global _default
    _default = model


def get_model(model: Model | RemoteModel | str | None = None) -> Model | RemoteModel:
    """A loaded `Model`: the object itself, or one loaded once per spec and shared by all queries."""
    from . import model as load

    model = model if model is not None else (_default or DEFAULT_MODEL)
    if isinstance(model, (Model, RemoteModel)):
        return model
    if not isinstance(model, str):
        raise TypeError(f"model must be a kvql.Model or a spec string, got {type(model).__name__}")
    if model not in _models:
        _models[model] = load(model)
    return _models[model]


def _run_sync(make_coro):
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        loop_running = False
    else:
        loop_running = True
    if not loop_running:
        return asyncio.run(make_coro())
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, make_coro()).result()


_DECODER_KEYS = DECODER_OPTIONS  # LMQL's decoder options (see kvql.runtime.context.decoding)


class Query:
    """A compiled query. Call it like the function it was defined as (sync or async), or use
    `run` (async), `run_sync` and `map`."""

    def __init__(self, source: str, *, name: str = "query", signature: inspect.Signature | None = None,
                 scope=None, is_async: bool = False, model=None, decoder: str | None = None, **decoder_kwargs):
        self.name = name
        self.signature = signature
        self._scope = scope or (lambda: {})
        self.is_async = is_async
        self.model = model
        self.decoder = decoder
        self.decoder_kwargs = decoder_kwargs
        self.source = source
        self._compiled: dict[tuple, CompiledQuery] = {}
        first = self._compile(tuple(signature.parameters) if signature else ())
        self.output_variables = first.holes
        self._decoding(first, {})  # bad decoder options fail at definition, not at the first call

    def _compile(self, params: tuple) -> CompiledQuery:
        if params not in self._compiled:
            self._compiled[params] = compile_query(self.source, list(params), self.name)
        return self._compiled[params]

    def _bind(self, args, kwargs) -> dict:
        if self.signature is None:
            if args:
                raise TypeError(f"query {self.name} takes its inputs as keyword arguments")
            return dict(kwargs)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"query {self.name}: {e}") from None
        bound.apply_defaults()
        return dict(bound.arguments)

    def _decoding(self, compiled: CompiledQuery, overrides: dict) -> Decoding:
        dec = compiled.decoder or Decoder()
        name = overrides.pop("decoder", None) or self.decoder or dec.name
        opts = {**dec.kwargs, **self.decoder_kwargs, **overrides}
        return decoding(name, opts)

    async def _execute(self, ctx: Context, args: tuple, kwargs: dict):
        """Run the body once in `ctx` (used for every run, and for nested queries)."""
        inputs = self._bind(args, kwargs)
        compiled = self._compile(tuple(self.signature.parameters) if self.signature else tuple(sorted(inputs)))
        scope = {**self._scope(), "__C": constraints}
        exec(compiled.code, scope)
        value = await scope["__kvql_query__"](ctx, inputs)
        await ctx.close_role()
        return value if compiled.returns else ctx.result()

    async def run(self, *args, model=None, **kwargs):
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in _DECODER_KEYS or k == "decoder"}
        inputs = self._bind(args, kwargs)
        compiled = self._compile(tuple(self.signature.parameters) if self.signature else tuple(sorted(inputs)))
        decoding = self._decoding(compiled, overrides)
        m = get_model(model or self.model or compiled.model)
        n = decoding.runs
        contexts = [Context(m, decoding, k) for k in range(n)]
        results = await asyncio.gather(*(self._execute(ctx, (), inputs) for ctx in contexts))
        self.last_traces = [ctx.trace() for ctx in contexts]  # one per run; see kvql.runtime.trace
        return list(results) if n > 1 else results[0]

    @property
    def last_trace(self):
        """The trace of this query's latest run (its first sample), also for queries with `return`."""
        return self.last_traces[0] if getattr(self, "last_traces", None) else None

    def run_sync(self, *args, **kwargs):
        return _run_sync(lambda: self.run(*args, **kwargs))

    def __call__(self, *args, **kwargs):
        if self.is_async:
            return self.run(*args, **kwargs)
        return self.run_sync(*args, **kwargs)

    def map(self, inputs, *, progress: bool = False, concurrency: int = 64, **options) -> list:
        """Run the query once per input (a dict of keyword inputs, a tuple of positional ones, or a single
        value), all concurrently in the engine; results keep the order of `inputs`."""
        inputs = list(inputs)

        async def main():
            from tqdm.auto import tqdm

            limit = asyncio.Semaphore(concurrency)
            bar = tqdm(total=len(inputs), desc=self.name, disable=not progress)

            async def one(x):
                async with limit:
                    if isinstance(x, dict):
                        r = await self.run(**x, **options)
                    elif isinstance(x, tuple):
                        r = await self.run(*x, **options)
                    else:
                        r = await self.run(x, **options)
                bar.update(1)
                return r

            try:
                return await asyncio.gather(*(one(x) for x in inputs))
            finally:
                bar.close()

        return _run_sync(main)

    def __repr__(self) -> str:
        return f"<kvql.Query {self.name} holes={self.output_variables}>"


def _function_scope(fn, frame=None):
    """The defining scope of `fn`: its globals, the locals of the scope it was defined in (a query's
    body is a docstring, so Python records no closure for the names it uses), then its closure."""
    def scope():
        s = dict(fn.__globals__)
        if frame is not None and frame.f_locals is not frame.f_globals:
            s.update(frame.f_locals)
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                s[var] = cell.cell_contents
            except ValueError:  # not assigned yet
                pass
        return s
    return scope


def _frame_scope(frame):
    g, loc = frame.f_globals, dict(frame.f_locals)
    return lambda: {**g, **loc}


def _raw_docstring(fn) -> str | None:
    """The docstring as written in the source file (escapes such as \\n left for the query to read, as
    LMQL does); `__doc__` when the source is not available."""
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        node = next(n for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
    except (OSError, TypeError, SyntaxError, StopIteration):
        return fn.__doc__
    first = node.body[0] if node.body else None
    if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)):
        return None
    literal = ast.get_source_segment(src, first.value)
    body = literal.lstrip("rRuUbBfF")
    quote = body[:3] if body[:3] in ('"""', "'''") else body[0]
    return body[len(quote):-len(quote)]


def query(fn=None, *, model=None, decoder: str | None = None, is_async: bool | None = None, **decoder_kwargs):
    """`@query` / `@query(model=..., decoder=..., n=..., temperature=..., max_len=...)` on a function whose
    docstring is the query, or `query("source")` (async by default, as in LMQL)."""
    if isinstance(fn, str):
        frame = inspect.currentframe().f_back
        return Query(fn, name="query", scope=_frame_scope(frame), is_async=True if is_async is None else is_async,
                     model=model, decoder=decoder, **decoder_kwargs)
    if fn is None:
        return functools.partial(query, model=model, decoder=decoder, is_async=is_async, **decoder_kwargs)
    frame = inspect.currentframe().f_back
    source = _raw_docstring(fn)
    if not source:
        raise ValueError(f"@query function {fn.__name__} has no docstring with the query")
    q = Query(source, name=fn.__name__, signature=inspect.signature(fn), scope=_function_scope(fn, frame),
              is_async=inspect.iscoroutinefunction(fn) if is_async is None else is_async,
              model=model, decoder=decoder, **decoder_kwargs)
    functools.update_wrapper(q, fn)
    return q


async def run(source: str, *args, **inputs):
    """Compile and run a query string (async); keyword arguments are its inputs."""
    frame = inspect.currentframe().f_back
    return await Query(source, scope=_frame_scope(frame), is_async=True).run(*args, **inputs)


def run_sync(source: str, *args, **inputs):
    frame = inspect.currentframe().f_back
    return Query(source, scope=_frame_scope(frame)).run_sync(*args, **inputs)


def F(template: str, constraints: str | None = None, model=None, **decoder_kwargs):
    """A one-statement query as a function: `F("Summarize {text}: [S]", "len(TOKENS(S)) < 20")(text=...)`.
    Inputs are the names interpolated in the template, positional in order of appearance; it returns
    the value of the one hole, or a dict when there are several."""
    parts = parse_prompt(template)
    names = list(dict.fromkeys(p.source for p in parts if isinstance(p, Expr) and p.source.isidentifier()))
    holes = [p.name for p in parts if isinstance(p, Hole)]
    if not holes:
        raise ValueError("F() needs a template with at least one [HOLE]")
    body = repr(template) + (f" where {constraints}" if constraints else "")
    ret = holes[0] if len(holes) == 1 else "{" + ", ".join(f"{h!r}: {h}" for h in holes) + "}"
    source = f"{body}\nreturn {ret}"
    frame = inspect.currentframe().f_back
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    return Query(source, name="F", signature=inspect.Signature(params), scope=_frame_scope(frame),
                 model=model, **decoder_kwargs)


async def generate(prompt: str, max_tokens: int = 32, model=None, temperature: float = 0.0, **kwargs) -> str:
    """Complete `prompt` (LMQL's `lmql.generate`): the generated text."""
    (c,) = await get_model(model).agenerate([prompt], max_tokens=max_tokens, temperature=temperature, **kwargs)
    return c.text


def generate_sync(prompt: str, max_tokens: int = 32, model=None, **kwargs) -> str:
    return _run_sync(lambda: generate(prompt, max_tokens, model, **kwargs))


@dataclass
class ScoreResult:
    """Log-probabilities of `values` as continuations of `prompt` (LMQL's `lmql.score`)."""

    prompt: str
    values: list
    logprobs: list[float]

    def probs(self) -> list[float]:
        top = max(self.logprobs)
        z = sum(math.exp(lp - top) for lp in self.logprobs)
        return [math.exp(lp - top) / z for lp in self.logprobs]

    def argmax(self):
        return self.values[self.logprobs.index(max(self.logprobs))]


async def score(prompt: str, values, model=None) -> ScoreResult:
    m = get_model(model)
    if isinstance(m, RemoteModel):
        raise ValueError("score() reads the model's logits: it needs a local model")
    values = list(values)
    ids = m.tokenizer(prompt, add_special_tokens=True).input_ids
    logps, _ = await score_continuations(m, ids, [str(v) for v in values])
    return ScoreResult(prompt, values, logps)


def score_sync(prompt: str, values, model=None) -> ScoreResult:
    return _run_sync(lambda: score(prompt, values, model))


__all__ = ["query", "run", "run_sync", "F", "generate", "generate_sync", "score", "score_sync", "Query",
           "set_default_model", "get_model", "LMQLResult", "QueryError", "UnmetConstraint"]

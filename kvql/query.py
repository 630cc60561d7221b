"""Query entry points, named as in LMQL: `query`, `run`, `run_sync`, `F`, `main` (`generate` and `score`:
kvql.generations; the model registry: kvql.registry).

`import kvql as lmql` works for ordinary LMQL code. Queries run on kvql's engine: every run of every
query shares one loaded model per spec and its radix KV cache; concurrent runs (asyncio, threads,
`Query.map`) are batched together by the engine.
"""

from __future__ import annotations

import ast
import asyncio
import builtins
import dis
import functools
import inspect
import textwrap
import types

from .lang.compiler import CompiledQuery, Decoder, compile_query
from .lang.prompt_string import Expr, Hole, parse_prompt
from .runtime import constraints
from .runtime.decoding import DECODER_OPTIONS, Decoding, decoding
from .runtime.errors import QueryError, UnmetConstraint
from .runtime.context import run_all
from .runtime.program import Program
from .runtime.result import LMQLResult
from .runtime.trace import label_all
from . import certificate as certificates
from . import output
from .registry import get_model, set_default_model
from .sync import run_sync as _run_sync
from .runtime.scoring import ScoringResult

ScoreResult = ScoringResult  # kvql's earlier name


_RUN_OPTIONS = ("model", "decoder", "output_writer", "certificate")


class _Deferred:
    """A query's model, loaded (by `get_model`) when a run first needs it: a query that ends before its
    first hole never loads its model, as in LMQL, so an unavailable one is no error there."""

    def __init__(self, spec):
        self._spec, self._model = spec, None

    def __getattr__(self, name):
        if self._model is None:
            self._model = get_model(self._spec)
        return getattr(self._model, name)


class UnresolvedVariable(TypeError, NameError):
    """A query reads names that are neither its inputs nor defined in its scope; raised when it is called,
    before it runs. A TypeError, as in LMQL, and a NameError, as Python would raise at the first use."""

    def __init__(self, names: list[str]):
        if len(names) == 1:
            super().__init__(f"Failed to resolve variable '{names[0]}' in LMQL query.")
        else:
            super().__init__("Failed to resolve variables in LMQL query: " + ", ".join(f"'{v}'" for v in names))
        self.name, self.names = names[0], names


class Query(Program):
    """A compiled query (a `kvql.runtime.program.Program`). Call it like the function it was defined as (sync or async), or use
    `run` (async), `run_sync` and `map`."""

    def __init__(self, source: str, *, name: str = "query", signature: inspect.Signature | None = None,
                 scope=None, is_async: bool = False, model=None, decoder: str | None = None, output_writer=None,
                 certificate=False, **decoder_kwargs):
        output.check(output_writer)
        certificates.check(certificate)
        self.name = name
        self.output_writer = output_writer
        self.certificate = certificate
        self.signature = signature
        self._scope = scope or (lambda: {})
        self.is_async = is_async
        self.model = model
        self.decoder = decoder
        self.decoder_kwargs = decoder_kwargs
        self.source = source
        self._compiled: dict[tuple, CompiledQuery] = {}
        self._free: dict[tuple, list[str]] = {}
        first = self._compile(tuple(signature.parameters) if signature else ())
        self.output_variables = first.holes
        self._decoding(first, {})  # bad decoder options fail at definition, not at the first call

    def _compile(self, params: tuple) -> CompiledQuery:
        if params not in self._compiled:
            self._compiled[params] = compile_query(self.source, list(params), self.name)
        return self._compiled[params]

    def compiled_for(self, inputs: dict) -> CompiledQuery:
        """The query compiled with its parameters, or, when it has none, with these inputs as locals."""
        params = tuple(self.signature.parameters) if self.signature else ()
        return self._compile(params or tuple(sorted(inputs)))

    def _free_names(self, params: tuple) -> list[str]:
        """Names the query compiled with `params` reads from outside (neither assigned in it nor Python
        builtins), in order of first use."""
        if params not in self._free:
            names = _global_names(self._compile(params).code)
            self._free[params] = [n for n in names if not n.startswith("__") and not hasattr(builtins, n)]
        return self._free[params]

    def bind(self, args, kwargs) -> dict:
        """The inputs of one call, by LMQL's rules: a query with parameters binds them like a Python
        function; one without (a query string, or a `def` with none) takes keyword arguments, and
        positional ones in order of first use of the names it reads that its scope does not define.
        Every other name it reads must resolve in its scope: if not, TypeError now, at the call."""
        params = tuple(self.signature.parameters) if self.signature else ()
        scope = self._scope()
        if params:
            try:
                bound = self.signature.bind(*args, **kwargs)
            except TypeError as e:
                raise TypeError(f"query {self.name}: {e}") from None
            bound.apply_defaults()
            inputs = dict(bound.arguments)
        else:
            if args:
                names = [n for n in self._free_names(()) if n not in scope and n not in kwargs]
                if len(args) != len(names):
                    raise TypeError(f"query {self.name} reads {len(names)} undefined name(s) {names}, given "
                                    f"{len(args)} positional argument(s); pass its inputs as keywords")
                kwargs = {**dict(zip(names, args)), **kwargs}
            inputs = dict(kwargs)
        missing = sorted({n for n in self._free_names(params or tuple(sorted(inputs)))
                          if n not in inputs and n not in scope})
        missing += [n for n in self._compile(params or tuple(sorted(inputs))).unresolved if n not in missing]
        if missing:
            raise UnresolvedVariable(missing)
        return inputs

    def __get__(self, obj, objtype=None):
        """A query defined in a class body is a method: `obj.q(...)` passes `obj` as `self`."""
        return self if obj is None else types.MethodType(self, obj)

    def check(self, inputs: dict, options: dict) -> Decoding:
        """What a run with these `inputs` and run `options` (`decoder=`, decoder options) can be checked for
        without a model, checked now (ValueError naming it): the decoder and its options, which it returns.
        (The query's syntax, its where clauses' literal regexes and its decoder clause's literal options are
        checked when it is defined.) `kvql run` calls it before it loads the model."""
        return self._decoding(self.compiled_for(inputs), dict(options))

    def _decoding(self, compiled: CompiledQuery, overrides: dict, clause_kwargs: dict | None = None) -> Decoding:
        """`clause_kwargs`: the decoder clause's arguments evaluated for this run (default: its literal ones)."""
        dec = compiled.decoder or Decoder()
        name = overrides.pop("decoder", None) or self.decoder or dec.name
        opts = {**(dec.kwargs if clause_kwargs is None else clause_kwargs), **self.decoder_kwargs, **overrides}
        return decoding(name, opts)

    def _module(self, compiled: CompiledQuery) -> dict:
        """The namespace of the compiled query's module, run in the query's scope (its prologue runs here)."""
        scope = {**self._scope(), "__C": constraints}
        exec(compiled.code, scope)
        return scope

    def body(self, inputs: dict):
        compiled = self.compiled_for(inputs)
        return self._module(compiled)["__kvql_query__"], bool(compiled.returns)

    def split_keywords(self, kwargs: dict) -> tuple[dict, dict]:
        """-> (the call's inputs, its runtime options), by LMQL's rule: a keyword the query reads (a
        parameter, or for a query without parameters a name its code uses) is an input, even one named
        like an option (`def q(model)`, `argmax(n=n)` called with n=2); `model`, `decoder`,
        `output_writer`, `certificate` and decoder options otherwise are options, and so is any other
        keyword of a query with parameters (ignored with a warning, as LMQL's backends ignore it)."""
        reads = set(self.signature.parameters) if self.signature else set(self._free_names(()))
        any_keyword_is_option = bool(reads) and self.signature is not None  # a query with parameters
        inputs, options = {}, {}
        for k, v in kwargs.items():
            is_option = any_keyword_is_option or k in _RUN_OPTIONS or k in DECODER_OPTIONS
            (options if is_option and k not in reads else inputs)[k] = v
        return inputs, options

    async def run(self, *args, **kwargs):
        """Run the query (once, or once per sample); keywords as `split_keywords` reads them. The options
        `model=`, `decoder=` and decoder options, `output_writer=` (see kvql.output) and `certificate=` (see
        kvql.certificate) override those given at definition."""
        kwargs, overrides = self.split_keywords(kwargs)
        model = overrides.pop("model", None)
        output_writer = overrides.pop("output_writer", None)
        certificate = overrides.pop("certificate", None)
        output_writer = output_writer if output_writer is not None else self.output_writer
        certificate = certificate if certificate is not None else self.certificate
        output.check(output_writer)
        certificates.check(certificate)
        inputs = self.bind(args, kwargs)
        compiled = self.compiled_for(inputs)
        module = self._module(compiled)
        decoding = self._decoding(compiled, overrides, module["__kvql_decoder__"](inputs))
        m = _Deferred(model or self.model or module["__kvql_model__"](inputs))  # `from` is evaluated only if used
        n = decoding.runs
        results, contexts = await run_all(self, m, decoding, inputs, (module["__kvql_query__"], bool(compiled.returns)),
                                          writer=output_writer)
        # one per run; see kvql.runtime.trace (None for a run that never needed its model)
        self.last_traces = [ctx.trace() if ctx.model_used else None for ctx in contexts]
        label_all(self.last_traces + [r.trace for r in results if isinstance(r, LMQLResult)], query=self.name,
                  inputs=inputs)
        for ctx, result in zip(contexts, results):
            await output.report(output_writer, ctx.prompt, ctx.variables, len(ctx.ids) if ctx.model_used else 0,
                                result)
        if certificate:
            cert = certificates.make(self.name, m, decoding, self.last_traces, results)
            results = certificates.deliver(certificate, cert, results)
        if not any(ctx.variables for ctx in contexts):
            # a query that ends before its first hole returns its one value, whatever the decoder: LMQL's
            # rule since 0.7.3 (whose PyPI release still wrapped it in a one-element list)
            return results[0]
        return results if n > 1 else results[0]

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

    def map(self, inputs, *, progress: bool | None = None, concurrency: int = 64, **options) -> list:
        """Run the query once per input (a dict of keyword inputs, a tuple of positional ones, or a single
        value), all concurrently in the engine; results keep the order of `inputs`. `progress`: a tqdm
        bar of runs done; by default shown for more than 8 inputs when stderr is a terminal."""
        import sys

        inputs = list(inputs)
        if progress is None:
            progress = len(inputs) > 8 and sys.stderr.isatty()

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


def query(fn=None, *, model=None, decoder: str | None = None, is_async: bool | None = None,
          input_variables: list[str] | None = None, **options):
    """`@query` / `@query(model=..., decoder=..., n=..., temperature=..., max_len=..., output_writer=...,
    certificate=...)` on a function (or method) whose docstring is the query, or `query("source")`
    (async by default, as in LMQL; `input_variables=["a", "b"]` gives it positional parameters)."""
    if isinstance(fn, Query):
        return fn
    if isinstance(fn, str):
        frame = inspect.currentframe().f_back
        signature = None if input_variables is None else inspect.Signature(
            [inspect.Parameter(v, inspect.Parameter.POSITIONAL_OR_KEYWORD) for v in input_variables])
        return Query(fn, name="query", signature=signature, scope=_frame_scope(frame),
                     is_async=True if is_async is None else is_async, model=model, decoder=decoder, **options)
    if input_variables is not None:
        raise TypeError("input_variables is for query strings; a decorated function's parameters are its inputs")
    if fn is None:
        return functools.partial(query, model=model, decoder=decoder, is_async=is_async, **options)
    frame = inspect.currentframe().f_back
    source = _raw_docstring(fn)
    if not source:
        raise ValueError(f"@query function {fn.__name__} has no docstring with the query")
    q = Query(source, name=fn.__name__, signature=inspect.signature(fn), scope=_function_scope(fn, frame),
              is_async=inspect.iscoroutinefunction(fn) if is_async is None else is_async,
              model=model, decoder=decoder, **options)
    functools.update_wrapper(q, fn)
    return q


async def run(source: str, *args, **inputs):
    """Compile and run a query string (async); keyword arguments are its inputs."""
    frame = inspect.currentframe().f_back
    return await Query(source, scope=_frame_scope(frame), is_async=True).run(*args, **inputs)


def run_sync(source: str, *args, **inputs):
    frame = inspect.currentframe().f_back
    return Query(source, scope=_frame_scope(frame)).run_sync(*args, **inputs)


def F(template: str, constraints: str | None = None, model=None, is_async: bool = False, **decoder_kwargs):
    """A one-statement query as a function: `F("Summarize {text}: [S]", "len(TOKENS(S)) < 20")(text=...)`.
    Inputs are the names interpolated in the template, positional in order of appearance; it returns
    the value of the one hole, or a dict when there are several (sync unless `is_async=True`)."""
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
                 is_async=is_async, model=model, **decoder_kwargs)


def main(query_fct, *args, **kwargs):
    """LMQL's `lmql.main`: call `query_fct` (a query, or any async function) and wait for its result."""
    result = query_fct(*args, **kwargs)
    if not inspect.isawaitable(result):
        return result

    async def wait():
        return await result
    return _run_sync(wait)


def _global_names(module_code) -> list[str]:
    """Global names read by the functions of a compiled query module (and the code nested in them), in
    order of first use, less those the module or its functions assign."""
    defined = {i.argval for i in dis.get_instructions(module_code) if i.opname in ("STORE_NAME", "DELETE_NAME")}
    loads = []

    def walk(code):
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                for ins in dis.get_instructions(const):
                    if ins.opname == "LOAD_GLOBAL":
                        loads.append(ins.argval)
                    elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                        defined.add(ins.argval)
                walk(const)

    walk(module_code)
    return [n for n in dict.fromkeys(loads) if n not in defined]


__all__ = ["query", "run", "run_sync", "F", "main", "Query",
           "ScoringResult", "ScoreResult", "set_default_model", "get_model", "LMQLResult", "QueryError",
           "UnmetConstraint"]

"""Trace of one query run: every prompt token, whether the engine served it from the cache or computed
it, which hole generated it, and per-hole values, where clauses and timings; as JSON or one
self-contained HTML page (`save`), or several runs (the samples of one call) in one file (`save_all`).

A token's `served` is decided the first time it is part of a prompt sent to the engine: `cached` if
the engine served it from the radix cache, `computed` if it ran it through the model, `unsent` if no
request ever included it (text after the last hole). So, without evictions, the number of `computed`
tokens equals the run's `computed_tokens` as the engine counts them. A hole's value is first made by
the model while decoding; when a later request sends it back, the engine finds the model's own output
in its cache, and the trace marks those tokens `cached` (all but the last token of a value, which the
model produced but never read).

Counts add up both ways: every token is cached, computed or never sent, and every token is prompt
text or generated (a hole's value): `Trace.counts()`. Those marks count each token once; the run's
requests count what each of them sent (`requests`, `request_tokens`, `request_cached`: a later hole's
request sends the earlier prompt again, and the backend serves it from its cache), and the summary's
`hit_rate` is theirs: cached over sent prompt tokens, as the engine's and servers' counters have it;
`request_disk` counts the cached ones whose KV the engine read back from its disk tier (`disk_cache=`) rather
than found in memory (0 without a tier, and from servers, which do not tell).
Special tokens (a chat template's role markers such as `<|im_start|>`) are marked `special` and shown
as labels, not as raw text.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

from .constraints import And, Node, describe

SERVED = ("cached", "computed", "unsent")
NEVER_SENT = ("never sent: no request to the model ever included this token (text after the last hole), "
              "so the model never read it")
_LABEL = {"cached": "cached", "computed": "computed", "unsent": "never sent"}
LONG_HOLE = 256
"""A hole with no token bound of its own says so once it has generated this many tokens: on stderr as it goes
(logger `kvql.query`, again at each doubling; on a local model, whose stop function runs in-process), and in its
trace row."""
SHOWN_SETUP_S = 0.05  # a hole's time before its request was queued is shown in its row from this many seconds on
DRAFTED = "drafted ahead and accepted (speculative decoding: computed with other tokens in one forward)"
FORCED = ("forced by the hole's constraint (it allowed only this token): appended without a decode step of "
          "its own (jump-forward)")


@dataclass
class TraceToken:
    id: int
    text: str
    served: str          # "cached" | "computed" | "unsent"
    hole: str | None     # the hole that generated it, None for prompt text
    forced: bool = False  # its hole's constraint forced it: appended without a decode step (jump-forward)
    special: bool = False  # one of the tokenizer's special tokens (a chat template's role markers, BOS, EOS)
    drafted: bool = False  # drafted ahead and accepted (speculative decoding: computed with others in one forward)


@dataclass
class TraceHole:
    name: str
    value: str
    constraints: str     # the hole's where clause as written (see `where_text`); "" when unconstrained
    tokens: int          # tokens the hole generated (healed: with those that re-generate the backed-up text)
    seconds: float
    forced: int = 0      # how many of them the constraint forced (jump-forward: no decode step of their own)
    healed: int = 0      # prompt tokens token healing backed up (their text generated again by this hole)
    setup_seconds: float = 0.0  # of `seconds`, before its request was queued: checks, its constraint compiled
    drafted: int = 0     # speculative decoding: tokens drafted for it and verified, and how many it accepted
    accepted: int = 0
    unbounded: bool = False  # no token bound of its own: only max_len / the context could end it


def where_text(constraint, name: str, plan=None) -> str:
    """The conditions on hole `name` as the query's where clause wrote them, joined by `and` ("" when
    none): the conjuncts of `constraint` (the statement's constraint IR, see kvql.runtime.constraints)
    that name it, then any condition only `plan` (its HolePlan) knows of, such as `[X: int]`."""
    conditions = []
    if isinstance(constraint, Node):
        items = constraint.items if isinstance(constraint, And) else (constraint,)
        conditions = [describe(c) for c in items if name in c.vars()]
    for c in getattr(plan, "conditions", ()):
        if c not in conditions:
            conditions.append(c)
    return " and ".join(conditions)


def _now() -> str:
    return datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _short(value, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


@dataclass
class Trace:
    tokens: list[TraceToken] = field(default_factory=list)
    holes: list[TraceHole] = field(default_factory=list)
    seconds: float = 0.0
    # what the page's title shows; all optional (see `label`)
    query: str | None = None     # the query's name
    model: str | None = None     # the model's name
    inputs: dict | None = None   # the call's inputs
    sample: int = 0              # which run of the call (sample or beam), from 0
    created: str = field(default_factory=_now)
    server: str | None = None    # the server's URL, for a remote model
    requests: int = 0            # requests the run sent, and their prompt tokens (all of them, cached or not)
    request_tokens: int = 0
    request_cached: int = 0      # of those, served from the cache
    request_disk: int = 0        # of those, read back from the engine's disk tier (the rest was in memory)

    def label(self, *, query: str | None = None, model: str | None = None, inputs: dict | None = None,
              sample: int | None = None) -> "Trace":
        """Set the title's fields that are given; returns the trace."""
        if query is not None:
            self.query = query
        if model is not None:
            self.model = model
        if inputs is not None:
            self.inputs = {str(k): _short(v) for k, v in inputs.items()}
        if sample is not None:
            self.sample = sample
        return self

    def counts(self) -> dict[str, dict[str, int]]:
        """Tokens by origin ("prompt": text of the query, "generated": hole values, "all") and by how
        the engine served them (cached, computed, unsent), with each row's "total"; rows and columns
        add up."""
        rows = {}
        for origin, keep in (("prompt", lambda t: t.hole is None), ("generated", lambda t: t.hole is not None),
                             ("all", lambda t: True)):
            row = {k: sum(1 for t in self.tokens if keep(t) and t.served == k) for k in SERVED}
            rows[origin] = {**row, "total": sum(row.values())}
        return rows

    def summary(self) -> dict:
        """Each token once (cached, computed, unsent, generated, forced, drafted, tokens), then the run's requests
        (`requests`, `request_tokens`, `request_cached`, `request_disk`) and their `hit_rate`."""
        count = {k: sum(t.served == k for t in self.tokens) for k in SERVED}
        generated = sum(t.hole is not None for t in self.tokens)
        return {**count, "generated": generated, "forced": sum(t.forced for t in self.tokens),
                "drafted": sum(t.drafted for t in self.tokens), "tokens": len(self.tokens),
                "requests": self.requests, "request_tokens": self.request_tokens,
                "request_cached": self.request_cached, "request_disk": self.request_disk,
                "hit_rate": self.request_cached / self.request_tokens if self.request_tokens else 0.0,
                "seconds": self.seconds}

    def meta(self) -> dict:
        return {"query": self.query, "model": self.model, "server": self.server, "inputs": self.inputs,
                "sample": self.sample, "created": self.created}

    def to_dict(self) -> dict:
        return {"meta": self.meta(), "summary": self.summary(), "counts": self.counts(),
                "tokens": [asdict(t) for t in self.tokens], "holes": [asdict(h) for h in self.holes]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def to_html(self) -> str:
        return page([self])

    def save(self, path: str | Path) -> None:
        """Write `.json` as JSON, anything else as HTML (`save_all` for several runs in one file)."""
        path = Path(path)
        path.write_text(self.to_json() if path.suffix == ".json" else self.to_html(), encoding="utf-8")

    # -- HTML ----------------------------------------------------------------------------------------
    def _section(self, of: int) -> str:
        s, c = self.summary(), self.counts()
        spans = []
        for i, t in enumerate(self.tokens):
            classes = (f"tok {t.served}" + (" gen" if t.hole else "") + (" forced" if t.forced else "")
                       + (" drafted" if t.drafted else "") + (" special" if t.special else ""))
            title = f"#{i} id {t.id} · {_LABEL[t.served]}" + (f" · generated by [{t.hole}]" if t.hole else "")
            if t.special:
                title += f" · the special token {t.text}"

            if t.forced:
                title += " · " + FORCED
            if t.drafted:
                title += " · " + DRAFTED
            if t.hole and t.served == "cached":
                title += " · the model's own output, reused from the cache"
            elif t.served == "unsent":
                title += " · " + NEVER_SENT
            spans.append(f'<span class="{classes}" data-served="{t.served}" data-id="{t.id}" '
                         f'title="{html.escape(title)}">{html.escape(_shown(t))}</span>')
        head = "".join(f"<th>{_LABEL[k]}</th>" for k in SERVED)
        body = "".join(
            f'<tr data-row="{origin}"><th>{label}</th>'
            + "".join(f'<td data-count="{k}">{c[origin][k]}</td>' for k in SERVED)
            + f'<td data-count="total">{c[origin]["total"]}</td></tr>'
            for origin, label in (("prompt", "prompt text"), ("generated", "generated by the model (hole values)"),
                                  ("all", "all tokens")))
        reused = sum(1 for t in self.tokens if t.hole and t.served == "cached")
        holes = "".join(
            f"<tr><td>[{html.escape(h.name)}]</td><td><code>{html.escape(h.constraints) or '—'}</code></td>"
            f"<td>{html.escape(repr(h.value))}</td><td>{h.tokens}" + (f" ({h.forced} forced)" if h.forced else "")
            + (f" ({h.accepted} of {h.drafted} drafted tokens accepted: speculative decoding)" if h.drafted else "")
            + (f" (healed: {h.healed} backed-up prompt token{'s' * (h.healed != 1)} generated again)"
               if h.healed else "")
            + (f" (no token bound of its own: add one, e.g. len(TOKENS({html.escape(h.name)})) &lt; 100)"
               if h.unbounded and h.tokens >= LONG_HOLE else "")
            + f"</td><td>{h.seconds:.3f} s" + (f" (before the request: {h.setup_seconds:.3f} s, checks and "
                                               "compiling its constraint)"
                                               if h.setup_seconds >= SHOWN_SETUP_S else "") + "</td></tr>"
            for h in self.holes)
        heading = f"Sample {self.sample + 1} of {of}" if of > 1 else "Run"
        summary = (f"{s['tokens']} tokens = {s['cached']} cached + {s['computed']} computed + {s['unsent']} never "
                   f"sent (each token counted once, when first sent); {s['generated']} of them generated by the "
                   f"model ({reused} reused from the cache, {s['forced']} forced by a constraint); "
                   f"{s['requests']} request{'s' * (s['requests'] != 1)} sent {s['request_tokens']} prompt tokens, "
                   f"{s['request_cached']} of them from the cache"
                   + (f" ({s['request_disk']} read back from disk)" if s["request_disk"] else "")
                   + f": hit rate {s['hit_rate']:.0%}; {s['seconds']:.2f} s")
        return f"""<section class="sample" id="sample-{self.sample}">
<h2>{heading}</h2>
<p class="summary">{html.escape(summary)}</p>
<table class="counts"><tr><th>tokens</th>{head}<th>total</th></tr>{body}</table>
<div class="prompt">{"".join(spans)}</div>
<table class="holes"><tr><th>hole</th><th>where</th><th>value</th><th>tokens generated</th><th>time</th></tr>{holes}</table>
</section>"""


def label_all(traces, **fields) -> None:
    """`Trace.label(**fields)` on each of `traces`, skipping None (a run that never needed its model)."""
    for t in traces:
        if t is not None:
            t.label(**fields)


def _where_lines(traces: list[Trace]) -> list[str]:
    """Each hole's where clause, once per distinct hole and clause, in order of first use."""
    seen = []
    for t in traces:
        for h in t.holes:
            line = f"[{h.name}] where {h.constraints}" if h.constraints else f"[{h.name}] (no where clause)"
            if line not in seen:
                seen.append(line)
    return seen


def _shown(t: TraceToken) -> str:
    """A token as the page shows it: a special token by its name (`<|im_start|>` -> `⟨im_start⟩`; the
    page marks it as a label), its line break kept so the template's layout stays readable."""
    if not t.special:
        return t.text
    name = t.text.strip().strip("<>").strip("|").strip() or t.text
    return f"⟨{name}⟩"


def title(traces: list[Trace]) -> str:
    first = traces[0] if traces else Trace()
    where = f" at {first.server}" if first.server else ""
    return f"kvql trace: {first.query or 'query'} on {first.model or 'a model'}{where}"


def page(traces: list[Trace]) -> str:
    """One self-contained HTML page: a header (query, model, inputs, date, where clauses, legend) and
    one section per trace (the samples of one call)."""
    first = traces[0] if traces else Trace()
    inputs = ", ".join(f"{k} = {v}" for k, v in (first.inputs or {}).items()) or "none"
    where = "\n".join(_where_lines(traces)) or "(no holes)"
    sections = "\n".join(t._section(len(traces)) for t in traces)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title(traces))}</title><style>
body {{ font: 14px/1.5 system-ui, sans-serif; margin: 2em; color: #222; max-width: 70em; }}
h1 {{ font-size: 1.5em; margin-bottom: .2em; }} h2 {{ font-size: 1.15em; margin: 1.5em 0 .3em; }}
dl.meta {{ display: grid; grid-template-columns: max-content 1fr; gap: .1em 1em; margin: .5em 0; }}
dl.meta dt {{ font-weight: 600; }} dl.meta dd {{ margin: 0; }}
#where {{ font-family: ui-monospace, monospace; background: #f6f6f6; padding: .5em 1em; margin: 0; white-space: pre-wrap; }}
.prompt {{ font-family: ui-monospace, monospace; white-space: pre-wrap; border: 1px solid #ccc; padding: 1em; }}
.tok.cached {{ background: #cfe0f6; }} .tok.computed {{ background: #fff; }}
.tok.unsent {{ color: #888; background: repeating-linear-gradient(45deg, #fff, #fff 3px, #eee 3px, #eee 6px); }}
.tok.gen {{ font-weight: 700; border-bottom: 3px solid #e3a21a; }}
.tok.gen.forced {{ font-weight: 400; font-style: italic; border-bottom: 3px dotted #e3a21a; }}
.tok.gen.drafted {{ border-bottom: 3px double #2a9d8f; }}
.tok.special {{ font-size: .8em; color: #555; border: 1px solid #aaa; border-radius: 3px; padding: 0 .2em; }}
.tok:hover {{ outline: 2px solid #333; }}
.legend {{ margin: .8em 0; }} .legend .tok {{ padding: 0 .4em; margin-right: .8em; font-family: ui-monospace, monospace; }}
table {{ border-collapse: collapse; margin: .6em 0; }} td, th {{ border: 1px solid #ddd; padding: .2em .6em; text-align: left; }}
table.counts td {{ text-align: right; font-variant-numeric: tabular-nums; }}
</style></head><body>
<h1 id="title">{html.escape(title(traces))}</h1>
<dl class="meta">
<dt>query</dt><dd id="query">{html.escape(first.query or "query")}</dd>
<dt>model</dt><dd id="model">{html.escape(first.model or "unknown")}</dd>
<dt>server</dt><dd id="server">{html.escape(first.server or "none: the model ran in this process")}</dd>
<dt>inputs</dt><dd id="inputs">{html.escape(inputs)}</dd>
<dt>date</dt><dd id="date">{html.escape(first.created)}</dd>
<dt>samples</dt><dd id="samples">{len(traces)}</dd>
</dl>
<h2>where</h2>
<pre id="where">{html.escape(where)}</pre>
<p class="legend" id="legend"><span class="tok cached" title="served from the radix KV cache: not recomputed">cached</span><span
 class="tok computed" title="run through the model in this run">computed</span><span
 class="tok unsent" title="{html.escape(NEVER_SENT)}">never sent</span><span class="tok gen cached"
 title="generated by the model (a hole's value); blue: the model's own output, reused from the cache">generated</span><span
 class="tok gen forced computed" title="{html.escape(FORCED)}">forced</span><br>
Background: how the engine served each token (blue: <b>cached</b>, white: <b>computed</b>, grey stripes: <b>never
sent</b> — {html.escape(NEVER_SENT)}). Bold and underlined: <b>generated</b> by the model; blue under the line means
the model's own earlier output was reused from the cache; italic with a dotted line: <b>forced</b> by the hole's
constraint (jump-forward), not chosen by a decode step. Hover a token for its id.</p>
{sections}
</body></html>
"""


def save_all(traces: list[Trace], path: str | Path) -> None:
    """Write the traces of one call (its samples) to one file: `.json` as JSON ({"traces": [...]}),
    anything else as one HTML page with a section per trace."""
    traces = [t for t in traces if t is not None]
    path = Path(path)
    if path.suffix == ".json":
        path.write_text(json.dumps({"traces": [t.to_dict() for t in traces]}, indent=1), encoding="utf-8")
    else:
        path.write_text(page(traces), encoding="utf-8")

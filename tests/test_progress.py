"""Progress bars: `generate(..., progress=True)` counts completions done / total with tqdm (as vLLM's
`LLM.generate` does) on the local and the remote backend; `Query.map` shows one by default only for
more than 8 inputs on a terminal."""

from __future__ import annotations

import asyncio
import fcntl
import io
import os
import select
import struct
import sys
import termios

import pytest
from tqdm import tqdm

import kvql


def bar_to(buf: io.StringIO, made: list):
    """A tqdm factory (vLLM's `use_tqdm` callable form) writing to `buf`; keeps each bar it makes."""
    def make(**kw):
        b = tqdm(file=buf, **kw)
        made.append(b)
        return b
    return make


def test_local_generate_counts_every_completion(make_model):
    m = make_model()
    buf, made = io.StringIO(), []
    out = m.generate(["one", "two", "three", "four"], max_tokens=3, n=2, temperature=1.0, seed=0,
                     progress=bar_to(buf, made))
    assert len(out) == 8
    (bar,) = made
    assert bar.total == 8 and bar.n == 8  # completions, not prompts
    assert "8/8" in buf.getvalue() and "Generating" in buf.getvalue()


def test_progress_true_writes_to_stderr_and_the_default_writes_nothing(make_model, capsys):
    m = make_model()
    m.generate(["a", "b", "c"], max_tokens=2)
    assert capsys.readouterr().err == ""
    m.generate(["a", "b", "c"], max_tokens=2, progress=True)
    assert "3/3" in capsys.readouterr().err


def test_local_agenerate_counts_completions(make_model):
    m = make_model()
    buf, made = io.StringIO(), []
    out = asyncio.run(m.agenerate(["x", "y", "z"], max_tokens=2, progress=bar_to(buf, made)))
    assert len(out) == 3 and made[0].n == made[0].total == 3
    assert "3/3" in buf.getvalue()


def test_a_failed_request_still_closes_the_bar(make_model):
    m = make_model()
    buf, made = io.StringIO(), []
    with pytest.raises(Exception):
        m.generate(["ok", "bad"], max_tokens=2, mask=lambda ids: 1 / 0, progress=bar_to(buf, made))
    (bar,) = made
    assert bar.disable  # closed: tqdm marks a closed bar disabled


def test_remote_generate_counts_every_completion(served_llama, tokenizer):
    m = kvql.model(served_llama, tokenizer=tokenizer)
    buf, made = io.StringIO(), []
    out = m.generate(["one", "two", "three"], max_tokens=2, n=2, temperature=1.0, seed=1, progress=bar_to(buf, made))
    assert len(out) == 6
    assert made[0].total == 6 and made[0].n == 6
    assert "6/6" in buf.getvalue()


def test_progress_must_be_a_bool_or_a_bar_factory(make_model):
    with pytest.raises(TypeError, match="progress"):
        make_model().generate(["a"], max_tokens=1, progress="yes")


QUERY = '"Say {x}: [Y]" where len(TOKENS(Y)) < 3'


def test_map_shows_no_bar_by_default_off_a_terminal(make_model, capsys):
    m = make_model()
    q = kvql.query(QUERY, is_async=False, model=m)
    assert len(q.map([{"x": i} for i in range(10)])) == 10  # pytest's captured stderr is no TTY
    assert capsys.readouterr().err == ""
    q.map([{"x": i} for i in range(10)], progress=True)
    assert "10/10" in capsys.readouterr().err


def _on_a_terminal(monkeypatch, fn) -> str:
    """Run `fn` with sys.stderr a real pseudo-terminal; what it wrote there."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a fresh pty is 0 columns wide
    term = os.fdopen(slave, "w")
    monkeypatch.setattr(sys, "stderr", term)
    try:
        fn()
        term.write("<end>")  # a pty hands written bytes to its reader a little later: read up to a marker
        term.flush()
        out = b""
        while b"<end>" not in out and select.select([master], [], [], 60)[0]:
            out += os.read(master, 65536)
        return out.decode(errors="replace").replace("<end>", "")
    finally:
        monkeypatch.undo()
        term.close()
        os.close(master)


def test_map_shows_a_bar_by_default_on_a_terminal_for_more_than_8_inputs(make_model, monkeypatch):
    m = make_model()
    q = kvql.query(QUERY, is_async=False, model=m)
    assert sys.stderr.isatty() is False
    shown = _on_a_terminal(monkeypatch, lambda: q.map([{"x": i} for i in range(9)]))
    assert "9/9" in shown
    assert _on_a_terminal(monkeypatch, lambda: q.map([{"x": i} for i in range(8)])) == ""  # a few: no bar
    assert _on_a_terminal(monkeypatch, lambda: q.map([{"x": i} for i in range(9)], progress=False)) == ""

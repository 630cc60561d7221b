"""Grammar sandbox: every constraint is compiled first in a child process, so that a crash or a hang in
llguidance's native compiler costs the request that sent it, never this process and its other requests.

Contract of `check(tokenizer, grammar)`: compiles `grammar` (llguidance's grammar text) for
`tokenizer` and computes its first token mask, in the child; returns None when both succeed within
`TIMEOUT_S` seconds of the child's CPU time (its wall time where that cannot be read; at most `WALL_FACTOR` times
as long in wall time), llguidance's error text when it reports one, and raises ValueError when the
compiler crashed (the child died) or took too long (the child is killed). CPU time, because children run at the
lowest CPU priority (`nice` 19): on a machine busy with forwards a compile waits, and is not refused for it. A
dead or killed child is replaced
on the next call. Thread-safe: up to `CHILDREN` children compile at once, each one constraint at a time (so a
few slow constraints leave a child for the next one; past that, a check waits for the first child free). A
child starts when a check finds none free and builds llguidance's view of each tokenizer once (a pass over its
vocabulary); `grammar.warm_up` pays both for the first child ahead of a first request.

The child runs this file as a script, not as part of the kvql package, so it imports only llguidance.
Messages are JSON lines: `{"tokenizer": KEY, "vocab": JSON | null, "eos": ID, "grammar": TEXT, "stack": BYTES}` in,
`{"error": TEXT | null}` out; the tokenizer's JSON is sent with the first message that names its KEY.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref

TIMEOUT_S = 10.0  # a margin: llguidance's own limits end pathological grammars far sooner (docs/benchmarks.md)
WALL_FACTOR = 6  # a compile may take this many times its CPU limit in wall time (a child starved by forwards)
POLL_S = 0.25  # how often a compile's CPU time is read while it runs
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
STACK_BYTES = 256 * 2**20  # as for the in-process compile: see grammar.py
CHILDREN = 8  # children compiling at once, at most


class _Child:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-s", os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.tokenizers: set[str] = set()
        self.buffer = b""

    def ask(self, message: dict, timeout: float) -> dict | None:
        """The child's answer, or None when it died or ran past `timeout` (it is then killed)."""
        try:
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        started, cpu = time.monotonic(), self._cpu_seconds()
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            waited = time.monotonic() - started
            spent = waited if cpu is None else self._cpu_seconds() - cpu
            if spent >= timeout or waited >= timeout * WALL_FACTOR:
                self.proc.kill()
                self.proc.wait()
                return None
            if not select.select([fd], [], [], min(POLL_S, timeout - spent))[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the child died
                self.proc.wait()
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def _cpu_seconds(self) -> float | None:
        """The child's CPU time so far (Linux: /proc), or None where it cannot be read (then `ask` counts wall
        time)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe to a dead child
                pass


_lock = threading.Condition()  # guards the children and the tokenizers' keys
_idle: list[_Child] = []  # children free for a check
_busy: set[_Child] = set()
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (key, vocab JSON)


def _tokenizer_json(tokenizer) -> tuple[str, str]:
    with _lock:
        known = _keys.get(tokenizer)
    if known is None:
        backend = copy.copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer does
        backend.no_padding()
        backend.no_truncation()
        vocab = backend.to_str()
        known = (hashlib.sha256(vocab.encode()).hexdigest(), vocab)
        with _lock:
            _keys[tokenizer] = known
    return known


def _take(key: str) -> _Child:
    """A live child free for a check (one that knows `key` first), started if none is and fewer than
    `CHILDREN` run; else wait for one."""
    with _lock:
        while True:
            for child in [c for c in _idle if c.proc.poll() is not None]:  # died while idle
                _idle.remove(child)
                child.close()
            if _idle:
                child = next((c for c in _idle if key in c.tokenizers), _idle[-1])
                _idle.remove(child)
                break
            if len(_busy) < CHILDREN:
                child = None
                break
            _lock.wait()
        if child is None:
            child = _Child()
        _busy.add(child)
        return child


def _give_back(child: _Child, alive: bool) -> None:
    with _lock:
        _busy.discard(child)
        if alive:
            _idle.append(child)
        _lock.notify()


def check(tokenizer, grammar: str, timeout: float | None = None) -> str | None:
    """Compile `grammar` for `tokenizer` in the sandbox: None, llguidance's error, or ValueError (see above)."""
    key, vocab = _tokenizer_json(tokenizer)
    child = _take(key)
    message = {"tokenizer": key, "vocab": None if key in child.tokenizers else vocab,
               "eos": tokenizer.eos_token_id, "grammar": grammar, "stack": STACK_BYTES}
    limit = TIMEOUT_S if timeout is None else timeout
    answer = None
    try:
        answer = child.ask(message, limit)
    finally:
        if answer is None:
            child.close()
        else:
            child.tokenizers.add(key)
        _give_back(child, answer is not None)
    if answer is None:
        code = child.proc.returncode
        if code is not None and code < 0 and code != -9:
            raise ValueError(f"the constraint crashed llguidance's grammar compiler (signal {-code}) in kvql's "
                             "sandbox process; it was refused and nothing else was affected")
        raise ValueError(f"compiling the constraint took longer than {limit:g} s of CPU time; it was refused")
    return answer["error"]


@atexit.register
def _close() -> None:
    with _lock:
        for child in [*_idle, *_busy]:
            child.close()


def _serve() -> None:
    """The child's loop: compile each grammar on a big stack, compute its first mask, say how it went. At the
    lowest CPU priority: compiles take what the engine's forwards leave, so several slow ones at once do not
    slow every request's decoding."""
    import llguidance

    try:
        os.nice(19)
    except OSError:
        pass

    limits = llguidance.LLParserLimits(verbose_errors=False)
    tokenizers: dict[str, llguidance.LLTokenizer] = {}

    def compile_one(message: dict) -> str | None:
        if message["vocab"] is not None:
            tokenizers[message["tokenizer"]] = llguidance.LLTokenizer(message["vocab"], eos_token=message["eos"])
        matcher = llguidance.LLMatcher(tokenizers[message["tokenizer"]], message["grammar"], log_level=0,
                                       limits=limits)
        if not matcher.is_error():
            matcher.compute_bitmask()
        return matcher.get_error() if matcher.is_error() else None

    for line in sys.stdin.buffer:
        message, answer = json.loads(line), {}

        def run():
            try:
                answer["error"] = compile_one(message)
            except Exception as e:  # llguidance's Python-level errors are the grammar's fault too
                answer["error"] = str(e)

        threading.stack_size(message["stack"])
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
        sys.stdout.write(json.dumps({"error": answer.get("error")}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()

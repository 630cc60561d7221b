"""Grammar sandbox: every constraint is compiled first in a child process, so that a crash or a hang in
llguidance's native compiler costs the request that sent it, never this process and its other requests.

Contract of `check(tokenizer, grammar)`: compiles `grammar` (llguidance's grammar text) for
`tokenizer` and computes its first token mask, in the child; returns None when both succeed within
`TIMEOUT_S` seconds, llguidance's error text when it reports one, and raises ValueError when the
compiler crashed (the child died) or took too long (the child is killed). A dead or killed child is replaced on the next call. Thread-safe: one
child per process, checks run one at a time. The child starts on first use and builds llguidance's view of
each tokenizer once (a pass over its vocabulary); `grammar.warm_up` pays both ahead of a first request.

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
STACK_BYTES = 256 * 2**20  # as for the in-process compile: see grammar.py


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
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                self.proc.kill()
                self.proc.wait()
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the child died
                self.proc.wait()
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:  # a broken pipe to a dead child
                pass


_lock = threading.Lock()
_child: _Child | None = None
_keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (key, vocab JSON)


def _tokenizer_json(tokenizer) -> tuple[str, str]:
    known = _keys.get(tokenizer)
    if known is None:
        backend = copy.copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer does
        backend.no_padding()
        backend.no_truncation()
        vocab = backend.to_str()
        known = _keys[tokenizer] = (hashlib.sha256(vocab.encode()).hexdigest(), vocab)
    return known


def check(tokenizer, grammar: str, timeout: float | None = None) -> str | None:
    """Compile `grammar` for `tokenizer` in the sandbox: None, llguidance's error, or ValueError (see above)."""
    global _child
    key, vocab = _tokenizer_json(tokenizer)
    with _lock:
        if _child is None or _child.proc.poll() is not None:
            if _child is not None:
                _child.close()
            _child = _Child()
        child = _child
        message = {"tokenizer": key, "vocab": None if key in child.tokenizers else vocab,
                   "eos": tokenizer.eos_token_id, "grammar": grammar, "stack": STACK_BYTES}
        limit = TIMEOUT_S if timeout is None else timeout
        answer = child.ask(message, limit)
        if answer is None:
            _child = None
            child.close()
            code = child.proc.returncode
            if code is not None and code < 0 and code != -9:
                raise ValueError(f"the constraint crashed llguidance's grammar compiler (signal {-code}) in kvql's "
                                 "sandbox process; it was refused and nothing else was affected")
            raise ValueError(f"compiling the constraint took longer than {limit:g} s; it was refused")
        child.tokenizers.add(key)
    return answer["error"]


@atexit.register
def _close() -> None:
    if _child is not None:
        _child.close()


def _serve() -> None:
    """The child's loop: compile each grammar on a big stack, compute its first mask, say how it went."""
    import llguidance

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

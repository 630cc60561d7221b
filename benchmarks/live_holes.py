"""When a query's output writer sees its hole (issue 43): the time from the query's start to the writer's first
call with text of the hole, against the time to the hole's end (the writer's call with the finished run), on the
embedded SmolLM2-135M. Uses only the public API, so the same script measures any checkout (before live holes,
the first call was the finished run's). Usage:
    .venv/bin/python benchmarks/live_holes.py [--tokens 120] [--repeats 3] [--dtype auto]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvql


class Clock:
    """An output writer noting when it is first called with text of the hole, and when with the finished run."""

    def __init__(self, started: float):
        self.started, self.first, self.final = started, None, None

    async def add_interpreter_head_state(self, variable, head, prompt, where, trace, is_valid, is_final, mask,
                                         num_tokens, program_variables):
        now = time.perf_counter() - self.started
        if self.first is None and program_variables.get("STORY"):
            self.first = now
        if is_final:
            self.final = now


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=120, help="the hole's token bound")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    m = kvql.model("smollm2-135m", dtype=args.dtype)
    query = f"'Once upon a time, in a small village,[STORY]' where len(TOKENS(STORY)) < {args.tokens}"
    kvql.run_sync(query, model=m)  # warm: the prompt cached, everything loaded
    rows = []
    for _ in range(args.repeats):
        clock = Clock(time.perf_counter())
        r = kvql.run_sync(query, model=m, output_writer=clock)
        rows.append((clock.first, clock.final, r.trace.holes[0].tokens))
    for first, final, tokens in rows:
        print(f"hole of {tokens} tokens: writer's first text {first * 1000:7.1f} ms, hole's end {final * 1000:7.1f} ms")
    print(f"median: first text at {statistics.median(r[0] for r in rows) / statistics.median(r[1] for r in rows):.1%}"
          f" of the time to the hole's end")
    m.close()


if __name__ == "__main__":
    main()

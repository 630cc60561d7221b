"""Server-sent events of one prompt's samples: `events(...)` turns the model's stream of chunks into
OpenAI's chunk objects (the caller's `make_chunk` shapes each), with a usage chunk last when asked; a
stream that fails after its 200 was sent ends with an `{"error": ...}` event and a chunk with
`finish_reason: "error"` for each unfinished sample. `sse(events)` is the HTTP response, ending in
`[DONE]`."""

from __future__ import annotations

import concurrent.futures
import json

from fastapi.responses import StreamingResponse


class Sent:
    """What a stream has sent of one sample: how many characters and token ids went out."""

    def __init__(self):
        self.chars, self.ids, self.started = 0, 0, False


async def events(first, chunks, n: int, make_chunk, usage_chunk, counters: dict, flight,
                 running_usage: int | None = None):
    """`first`: the stream's first chunk (awaited before the 200, so that a bad request is a 400);
    `chunks`: the rest (the model's stream, closed here: a client that went away cancels its request);
    `make_chunk(sample, text, token_ids, completion, first)` -> one event; `usage_chunk(completions)` -> the
    last, or None; `flight` (metrics.py) is told the completions when the stream ends. `running_usage`: the
    prompt's token count, to put the usage so far in every chunk (vLLM's `continuous_usage_stats`)."""
    chunk, unfinished, sent, done = first, set(range(n)), {}, []
    generated = 0
    try:
        while chunk is not None:
            s = sent.setdefault(chunk.sample, Sent())
            c = chunk.completion
            if c is not None:
                done.append(c)
                unfinished.discard(chunk.sample)
                text, ids = c.text[s.chars:], c.token_ids[s.ids:]
            else:
                text, ids = chunk.text, [chunk.token_id]
            event = make_chunk(chunk.sample, text, ids, c, not s.started)
            generated += len(ids)
            if running_usage is not None:
                event["usage"] = {"prompt_tokens": running_usage, "completion_tokens": generated,
                                  "total_tokens": running_usage + generated}
            elif usage_chunk is not None:
                event["usage"] = None  # OpenAI's: null in every chunk but the last
            yield event
            s.started, s.chars, s.ids = True, s.chars + len(text), s.ids + len(ids)
            chunk = await anext(chunks, None)
        if usage_chunk is not None:
            yield usage_chunk(done)
    except Exception as e:  # the 200 is sent: say so in the stream, not by ending it silently
        counters["errors"] += 1
        request_fault = isinstance(e, (ValueError, TypeError))
        message = ("the request was cancelled: the server is shutting down"
                   if isinstance(e, concurrent.futures.CancelledError)
                   else str(e) if request_fault else "internal server error")
        yield {"error": {"message": message, "type": "invalid_request_error" if request_fault else "server_error",
                         "param": None, "code": None}}
        for sample in sorted(unfinished):
            failed = make_chunk(sample, "", [], None, sample not in sent)
            for choice in failed["choices"]:
                choice["finish_reason"] = "error"
            yield failed
    finally:
        flight.finish(done)
        await chunks.aclose()


def sse(stream) -> StreamingResponse:
    async def body():
        async for event in stream:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")

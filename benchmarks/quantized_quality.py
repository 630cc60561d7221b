"""What quantized weights cost in quality (issue 44): per model and format, on a fixed text, against the model with its
weights dequantized to float32 (what kvql runs by default, in its exact mode):
- top-1 agreement: the share of positions where the quantized model's most likely next token is the dequantized
  model's;
- perplexity of the text under each (exp of the mean negative log-likelihood of each next token).
Formats: gguf (the file's own blocks: SmolLM2 Q4_1 with a Q8_0 head, Gemma 3 Q4_K_M's mix), int8 and int4 (kvql's
quantization per group of 32 of the dequantized weights). Activations in float32 (--dtype), one forward over the
whole text through the model's own forward.
Usage: .venv/bin/python benchmarks/quantized_quality.py [--models smollm2-135m,gemma3-270m] [--formats gguf,int8,int4]
"""

from __future__ import annotations

import argparse
import math

import torch

import kvql
from single_stream import weight_bytes  # benchmarks/ is the script's directory

TEXT = """The lighthouse stood at the end of a narrow spit of rock, and for most of the year nobody visited it but the
keeper and the gulls. Every evening he climbed the one hundred and twelve steps, trimmed the wick, wound the clockwork
that turned the lens, and wrote the weather in a thick book with a green cover. The entries were short: wind from the
west, light rain, two fishing boats at dusk. Some nights nothing happened at all, and he wrote that too.

In the spring a surveyor arrived with a case of instruments and a letter from the harbour board. The board wanted to
know whether the light could be run by a machine, and whether the keeper could be spared. The surveyor measured the
tower, timed the rotation of the lens, and counted the steps twice because he did not believe the first number. He
stayed for a week. In the evenings the two men played cards and argued about the best way to cook mackerel.

When the report was finished, it said that a machine could turn the lens but could not read the sky, could not see a
boat in trouble, and could not write in a green book that a storm had come early. The board read it, filed it, and
sent the keeper a new barometer. He hung it beside the door and tapped it every morning, although he said the gulls
had always known the weather first.

Years later, when the light was finally automated, the green books were taken to the museum in the town. Visitors
still turn the pages, reading about wind and rain and fishing boats, and the nights when nothing happened at all."""


@torch.inference_mode()
def logits(hf, ids: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=ids[None]).logits[0].float()


def perplexity(lg: torch.Tensor, ids: torch.Tensor) -> float:
    nll = torch.nn.functional.cross_entropy(lg[:-1], ids[1:])
    return math.exp(float(nll))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--formats", default="gguf,int8,int4")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    print(f"{'model':<14} {'weights':<12} {'MiB':>6} {'top-1 agreement':>16} {'perplexity':>11}")
    for spec in args.models.split(","):
        base = kvql.model(spec, dtype=args.dtype)
        ids = torch.tensor(base.tokenizer.encode(TEXT))
        want = logits(base.hf_model, ids)
        size = weight_bytes(base.hf_model.parameters())
        print(f"{spec:<14} {'dequantized':<12} {size / 2**20:6.0f} {'-':>16} {perplexity(want, ids):11.3f}"
              f"   ({len(ids)} tokens)", flush=True)
        base.close()
        for weights in args.formats.split(","):
            m = kvql.model(spec, dtype=args.dtype, weights=weights)
            got = logits(m.hf_model, ids)
            agree = float((got.argmax(-1) == want.argmax(-1)).float().mean())
            size = weight_bytes(m.hf_model.buffers())
            print(f"{spec:<14} {weights:<12} {size / 2**20:6.0f} {agree:16.1%} {perplexity(got, ids):11.3f}",
                  flush=True)
            m.close()


if __name__ == "__main__":
    main()

"""Writes docs/models.md's table of model families from the checks tests/test_families.py asserts (tests/families.py):
for each tiny random model, fp32 greedy equal to transformers.generate cold / warm / staggered on both CPU
attention paths, bf16 batched equal to alone, the path that runs it (ragged, or the model's own forward and why),
how many modules run the fused layers, its attention variants (windows, chunks, soft-caps, sinks, ALiBi, MLA); for refused
families the engine's reason. Run: `.venv/bin/python scripts/family_table.py` (about a minute; rewrites the
part of docs/models.md between the `families` markers, prints the table)."""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
warnings.filterwarnings("ignore")

import families as F  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from conftest import CORPUS  # noqa: E402


def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def mark(ok: bool) -> str:
    return "yes" if ok else "**no**"


def rows(tok) -> list[str]:
    out = ["| family | model type | fp32 cold / warm / staggered (paged kernel; gather + SDPA: the ragged path) "
           "| bf16 batched = alone | path | fused modules | attention variants |", "|---|---|---|---|---|---|---|"]
    for name in F.FAMILIES:
        cells = []
        for path in ("1", "0") if name not in F.OWN else ("1",):  # the own forward: no attention path of kvql's
            os.environ["KVQL_PAGED_ATTENTION"] = path
            r = F.check_exact(name, tok)
            cells.append(" / ".join(mark(r[k] == r["reference"]) for k in ("cold", "warm", "staggered")))
        os.environ.pop("KVQL_PAGED_ATTENTION")
        bf16 = F.check_bf16_invariant(name, tok)
        layers = r["geometry"].layers
        variants = [f"{sum(bool(getattr(x, k)) for x in layers)} of {len(layers)} layers {what}"
                    for k, what in (("window", "windowed"), ("chunk", "chunked")) if any(getattr(x, k) for x in layers)]
        variants += [what for k, what in (("softcap", "soft-capped scores"), ("sinks", "attention sinks"),
                                          ("alibi", "ALiBi"), ("latent", "MLA (absorbed)"))
                     if any(getattr(x, k) for x in layers)]
        window = ", ".join(variants) or "none"
        own = r["geometry"].own
        path = "ragged" if own is None else "own forward: " + own.split(" (")[0].split(";")[0].replace("|", "\\|")
        out.append(f"| {name} | `{F.FAMILIES[name][0]}` | {'; '.join(cells)} | "
                   f"{'yes (12/12)' if not bf16 else f'**no** ({12 - len(bf16)}/12)'} | {path} | {r['fused']} | "
                   f"{window} |")
    for name, (model_type, _, _) in F.REFUSED.items():
        reason = F.check_refused(name, tok).replace("|", "\\|")
        out.append(f"| {name} | `{model_type}` | refused: {reason} | | | | |")
    return out


def main() -> None:
    table = "\n".join(rows(tokenizer()))
    print(table)
    readme = ROOT / "docs" / "models.md"
    text = readme.read_text()
    block = f"<!-- families:begin (scripts/family_table.py writes this table) -->\n{table}\n<!-- families:end -->"
    new, n = re.subn(r"<!-- families:begin.*?<!-- families:end -->", lambda _: block, text, flags=re.S)
    if n:
        readme.write_text(new)


if __name__ == "__main__":
    main()

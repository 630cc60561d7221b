"""The decode room: from logits to the next token of each request. Sampling (`sampler`), token masks
(`masks`), grammars (`grammar`, `grammar_sandbox`), token healing (`healing`), drafts for speculation from the
cache (`drafts`) and incremental detokenization (`detokenizer`). Imports the engine's shared data (`request`)
and the cache room (a draft walks the tree); never the step loop."""

"""The decode room: from logits to the next token of each request. Sampling (`sampler`), token masks
(`masks`), grammars (`grammar`, `grammar_sandbox`), token healing (`healing`), drafts for speculation from the
cache (`drafts`), and the mask worker (`mask_worker`). Imports the engine's shared data (`request`, `segment`,
`detokenizer`, `openmp`) and the cache room (a draft walks the tree); never the step loop."""

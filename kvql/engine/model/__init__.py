"""The model room: one forward of a model over a ragged batch with its K/V in the pool. Admission (`admission`),
the attention plan of a step (`attention_plan`) and the attention through the pool (`pool_attention`), the
runner (`model_runner`), the per-layer description of a step (`step`), its lean forward (`lean_model`), the CPU
linear layers and fused modules (`cpu_linear`, `fused_layers`), quantized weights (`quantized`) and the C kernels
(`kernels/`). Imports the engine's shared data (`segment`, `openmp`) at most: nothing of the cache (the pool and
the snapshot store are handed in), the decode room or the step loop (tests/import_graph.py checks)."""

"""The blocks every architecture shares: `layers` (causal LM top, decoder layer, norms, SwiGLU, the
attention context), `rope`, `attention` (the paged GQA K/V cache and attention tail), `moe` (router
-> experts backend -> finalize -> combine), `spec` (checkpoint tensor specs in the Hugging Face
per-expert layout), `experts` (stacking per-expert tensors into ExpertWeights) and `arch` (the
base of every architecture's `Arch`, with the conventions most of them share)."""

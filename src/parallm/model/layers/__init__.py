"""The decoder's layer kinds, one per file: attention (MHA / GQA, sliding windows, sinks), MLA, the
dense MLP, the MoE block and its routing, Gated DeltaNet, and the LoRA adapters that wrap their
projections (with their plan: which HF module each adapter belongs to)."""

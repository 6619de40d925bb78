"""Position encodings: rotary embeddings (``rope.py``: default, linear, dynamic NTK, llama3) and YaRN with
partial rotary dimensions (``yarn.py``: DeepSeek-V3 / Kimi-K2, GLM-4.5, and YaRN-scaled dense models)."""

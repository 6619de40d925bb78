"""Model families. Importing this package registers LLaMA, Qwen2, Qwen3, Mistral, the mixture-of-experts
families Qwen3-MoE, Qwen2-MoE and Mixtral, DeepSeek-V3 (Kimi-K2, Moonlight), GLM-4.5, gpt-oss, and the hybrid
Gated DeltaNet families Qwen3.5, Qwen3.5-MoE and Qwen3-Next, the DeepSeek Sparse Attention families
DeepSeek-V3.2 and GLM-5, the Mamba-2 hybrid Nemotron-H / Nemotron-3, Kimi-K2.5 / K2.6 (a vision wrapper over
DeepSeek-V3), MiniMax-M2, Gemma 3 text and the Gemma 4 text subset."""

from . import (deepseek_v3, glm4_moe, gpt_oss, llama, mistral, mixtral, qwen2,  # noqa: F401  (registration)
               qwen2_moe, qwen3, qwen3_5, qwen3_moe, qwen3_next)
from . import dsa  # noqa: F401  (registration: DeepSeek-V3.2, GLM-5)
from . import nemotron_h  # noqa: F401,E402  (registration)
from . import kimi_k25  # noqa: F401,E402  (registration: the Kimi-K2.5 / K2.6 wrapper)
from . import minimax_m2  # noqa: F401,E402  (registration)
from . import gemma3  # noqa: F401,E402  (registration: Gemma 3 text)
from . import gemma4  # noqa: F401,E402  (registration: Gemma 4 text)
from . import gemma4_vl  # noqa: F401,E402  (registration: the Gemma 4 wrapper's language model)
from . import deepseek_v4  # noqa: F401,E402  (registration: DeepSeek-V4)
from .registry import FAMILIES, Family, family_of, load_config, spec_from_config, supported_architectures

__all__ = ["FAMILIES", "Family", "family_of", "load_config", "spec_from_config", "supported_architectures"]

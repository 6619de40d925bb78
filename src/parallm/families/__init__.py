"""Model families. Importing this package registers LLaMA, Qwen2, Qwen3, Mistral, the mixture-of-experts
families Qwen3-MoE, Qwen2-MoE and Mixtral, DeepSeek-V3 (Kimi-K2, Moonlight) and GLM-4.5."""

from . import (deepseek_v3, glm4_moe, llama, mistral, mixtral, qwen2, qwen2_moe, qwen3,  # noqa: F401  (registration)
               qwen3_moe)
from .registry import FAMILIES, Family, family_of, load_config, spec_from_config, supported_architectures

__all__ = ["FAMILIES", "Family", "family_of", "load_config", "spec_from_config", "supported_architectures"]

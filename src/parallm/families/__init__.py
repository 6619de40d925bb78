"""Model families. Importing this package registers LLaMA, Qwen2, Qwen3, Mistral and the mixture-of-experts
families Qwen3-MoE, Qwen2-MoE and Mixtral."""

from . import llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe  # noqa: F401  (registration)
from .registry import FAMILIES, Family, family_of, load_config, spec_from_config, supported_architectures

__all__ = ["FAMILIES", "Family", "family_of", "load_config", "spec_from_config", "supported_architectures"]

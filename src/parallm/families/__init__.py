"""Model families. Importing this package registers LLaMA, Qwen2, Qwen3 and Mistral."""

from . import llama, mistral, qwen2, qwen3  # noqa: F401  (registration)
from .registry import FAMILIES, Family, family_of, load_config, spec_from_config, supported_architectures

__all__ = ["FAMILIES", "Family", "family_of", "load_config", "spec_from_config", "supported_architectures"]

"""Model families. Importing this package registers LLaMA and Qwen2."""

from . import llama, qwen2  # noqa: F401  (registration)
from .registry import FAMILIES, Family, family_of, load_config, spec_from_config, supported_architectures

__all__ = ["FAMILIES", "Family", "family_of", "load_config", "spec_from_config", "supported_architectures"]

"""Optional integrations with other projects. Each submodule imports its project only when it is imported
itself (``from parallm.integrations import vllm``); ``import parallm`` imports none of them."""

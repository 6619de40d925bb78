"""Imported once by the launcher's forkserver, so the ranks forked from it start with these modules loaded."""

import warnings

import torch  # noqa: F401

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import parallm  # noqa: F401
    from parallm.cli_impl import checks, job  # noqa: F401
    try:  # rank 0 runs the transformers reference; the others never touch it (fork shares the pages)
        import transformers  # noqa: F401
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401
        from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
    except Exception:  # noqa: BLE001 - imported again (with its real error) where it is needed
        pass

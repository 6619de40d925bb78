"""The implementation of the ``parallm`` command line (``parallm.cli`` holds the argument parser).

Modules:
    common     errors, number formatting, the results table (no torch)
    launch     standalone launching (spawns local ranks) and torchrun detection
    worker     a spawned rank: process target (forked from a forkserver) or ``python -m parallm.cli_impl.worker``
    preload    what that forkserver imports once (torch, megatron-core, parallm, transformers)
    job        what every rank runs: a list of layout checks, sharing one process group
    checks     one layout check: load, compare with transformers, one SGD step, save, reload
    demo       the tiny demo checkpoints and the demo's layouts
    preflight  checkpoint validation without a process group (used by verify and inspect)
    inspect_cmd  ``parallm inspect``
"""

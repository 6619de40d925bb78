import os
import sys

import pytest
import torch

# One thread in the test process too: the reference models are tiny, and it keeps CPU free for spawned ranks.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    """A one-rank gloo world with parallm's groups, for in-process tests (megatron-core's linears need parallel
    groups)."""
    import torch.distributed as dist

    import parallm
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg')}/store", rank=0,
                            world_size=1)
    try:
        parallm.init_parallel()
        yield
    finally:
        parallm.destroy_parallel()
        dist.destroy_process_group()

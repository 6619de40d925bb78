import os
import sys

import torch

# One thread in the test process too: the reference models are tiny, and it keeps CPU free for spawned ranks.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))

"""tinker-cookbook's own training loops, unmodified, against a parallm Tinker server (run as a script by
tests/test_tinker_vllm.py, and by hand; the commands are in docs/tinker.md):

    python tests/tinker_cookbook_runs.py sft URL MODEL_DIR LOG_DIR [STEPS]
    python tests/tinker_cookbook_runs.py rl URL MODEL_DIR LOG_DIR [STEPS]

``sft``: ``tinker_cookbook.supervised.train.main`` (the loop behind recipes/sl_loop.py and every supervised
recipe) on a small local chat dataset (``FromConversationFileBuilder`` over a JSONL file written here), with the
``role_colon`` renderer. ``rl``: ``tinker_cookbook.rl.train.main`` (the loop behind the RL recipes: sampling
through ``save_weights_and_get_sampling_client``, group-centred advantages, ``importance_sampling``) on a local
task written here with the cookbook's ``ProblemEnv``: the reward is 1 when the answer holds a digit. Both read
the loop's own ``metrics.jsonl``. The model name is the checkpoint directory (the cookbook's tokenizer comes from
it). ``TINKER_API_KEY`` must be set (any ``tml-`` key, or the server's)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys

import chz

from tinker_cookbook import renderers
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.problem_env import ProblemEnv, ProblemGroupBuilder
from tinker_cookbook.rl.types import RLDataset, RLDatasetBuilder
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import get_tokenizer

RENDERER = "role_colon"
WORDS = ["apple", "river", "stone", "cloud", "green", "quiet", "north", "light"]


def _conversations(n: int, seed: int = 0) -> list[dict]:
    """Answer with the word repeated: 'User: repeat stone' -> 'Assistant: stone stone'."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        w = rng.choice(WORDS)
        out.append({"messages": [{"role": "user", "content": f"repeat {w}"},
                                 {"role": "assistant", "content": f"{w} {w}"}]})
    return out


def run_sft(url: str, model: str, log_dir: str, steps: int) -> None:
    os.makedirs(log_dir, exist_ok=True)
    data = os.path.join(log_dir, "conversations.jsonl")
    with open(data, "w") as f:
        for c in _conversations(8 * steps):
            f.write(json.dumps(c) + "\n")
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=128,
                                            batch_size=8)
    config = sl_train.Config(log_path=log_dir, model_name=model, recipe_name="parallm_tinker_test",
                             renderer_name=RENDERER, dataset_builder=FromConversationFileBuilder(
                                 file_path=data, common_config=common),
                             learning_rate=1e-2, lr_schedule="constant", lora_rank=8, base_url=url, save_every=0,
                             eval_every=0, infrequent_eval_every=0, max_steps=steps)
    asyncio.run(sl_train.main(config))


class DigitEnv(ProblemEnv):
    """'Say a number.' -> reward 1 when the answer holds a digit (no format reward: format_coef 0)."""

    def __init__(self, renderer):
        super().__init__(renderer, format_coef=0.0)

    def get_question(self) -> str:
        return "say a number"

    def check_answer(self, sample_str: str) -> bool:
        return any(ch.isdigit() for ch in sample_str)

    def check_format(self, sample_str: str) -> bool:
        return True

    def get_reference_answer(self) -> str:
        return "7"


class DigitDataset(RLDataset):
    def __init__(self, renderer, batches: int, groups: int, group_size: int):
        self.renderer, self.batches, self.groups, self.group_size = renderer, batches, groups, group_size

    def get_batch(self, index: int):
        return [ProblemGroupBuilder(env_thunk=lambda: DigitEnv(self.renderer), num_envs=self.group_size,
                                    dataset_name="digits") for _ in range(self.groups)]

    def __len__(self) -> int:
        return self.batches


@chz.chz
class DigitDatasetBuilder(RLDatasetBuilder):
    model: str
    batches: int
    groups: int = 4
    group_size: int = 8

    async def __call__(self):
        renderer = renderers.get_renderer(RENDERER, get_tokenizer(self.model))
        return DigitDataset(renderer, self.batches, self.groups, self.group_size), None


def run_rl(url: str, model: str, log_dir: str, steps: int) -> None:
    config = rl_train.Config(learning_rate=1e-2, dataset_builder=DigitDatasetBuilder(model=model, batches=steps),
                             model_name=model, recipe_name="parallm_tinker_test", max_tokens=3, log_path=log_dir,
                             eval_every=0, save_every=0, renderer_name=RENDERER, lora_rank=8, base_url=url,
                             loss_fn="importance_sampling")
    asyncio.run(rl_train.main(config))


def metrics(log_dir: str) -> list[dict]:
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


if __name__ == "__main__":
    kind, url, model, log_dir = sys.argv[1:5]
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    (run_sft if kind == "sft" else run_rl)(url, model, log_dir, steps)

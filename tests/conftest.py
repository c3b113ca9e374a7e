import os
import random
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)   # recipes name plug-ins relative to the project folder

import mt_grpo_trainer as M  # noqa: E402
from tasks import toy_kv  # noqa: E402


def toy_tokenizer():
    rng = random.Random(0)
    demos = [toy_kv.demonstration(r, "", rng) for r in toy_kv.make_dataset(256)]
    return toy_kv.build_tokenizer([f"{m['role']}\n{m['content']}" for d in demos for m in d])


@pytest.fixture(scope="session")
def tok():
    return toy_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tok):
    """A random-initialised 1-layer Qwen3 with the toy tokenizer (no warm-start): fast, real code paths."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None))
    path = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture()
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def recipe_cfg(tmp_path, *overrides):
    """The default recipe with test overrides."""
    return M.load_config("hf_recipes/toy/toy-kv--mt-grpo.yaml", [f"output_dir={tmp_path}/run", *overrides])

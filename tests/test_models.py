"""Any causal LM trains (issue 46): a family checked exact in packed rows (PACKED_MODEL_TYPES) packs, any other trains
in padded rows, one sample a row, and the line at load says which path it took and why. Each family is a tiny random
model of the pinned transformers' own config class (no download)."""

import pytest
import torch

import mt_grpo_trainer as M
from test_packing import assert_exact, random_group
from test_train import run_cfg

CPU = torch.device("cpu")
SIZES = {  # a small decoder: 2 layers, 2 heads sharing 1 KV head of size 32
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
WINDOWED = {  # families with a sliding window, set shorter than the samples so that it decides what a token sees
    "gemma3_text": {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]},
}


def tiny_config(model_type: str, vocab: int, **extra):
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type, vocab_size=vocab, **SIZES, **extra)


def tiny_model(config, seed: int = 0):
    """A random model of `config`, loaded as load_models loads it: packed attention if it packs, else its default."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kw = {}
    if M.layout(config)[0]:
        kw["attn_implementation"] = M.packed_attention(CPU)
    return AutoModelForCausalLM.from_config(config, **kw)


def saved_model(config, tok, path) -> str:
    tiny_model(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model_type", list(WINDOWED))
def test_a_family_that_does_not_pack_trains_padded_rows_exactly_and_says_so_at_load(model_type, tok, tmp_path, capsys):
    config = tiny_config(model_type, len(tok), **WINDOWED[model_type])
    packed, why = M.layout(config)
    assert not packed and why.startswith(f"padded rows: {model_type} "), why
    samples = random_group(len(tok), [3, 70, 7, 40], shared=20)
    assert assert_exact(tiny_model(config), samples) == 0, "padded rows share nothing"
    model_dir = saved_model(config, tok, tmp_path / "model")
    history = M.train(run_cfg(tmp_path, model_dir, "run", "max_steps=1", "save_steps=0"))
    assert len(history) == 1 and history[0]["loss/grad_norm"] > 0, "a step trained"
    assert history[0]["train/shared_prefix_tokens_saved"] == 0
    assert f"[mt-grpo] {why}\n" in capsys.readouterr().out, "the load line names the path and why"


def test_a_family_that_packs_says_so_at_load(tiny_model_dir, tmp_path, capsys):
    history = M.train(run_cfg(tmp_path, tiny_model_dir, "run", "max_steps=1", "save_steps=0"))
    assert history[0]["train/shared_prefix_tokens_saved"] > 0, "the group's prompt is held once"
    assert "[mt-grpo] packed rows: qwen3 is checked exact\n" in capsys.readouterr().out

"""Any causal LM trains (issue 46): a family checked exact in packed rows (PACKED_MODEL_TYPES) packs, any other trains
in padded rows, one sample a row, and the line at load says which path it took and why. Each family is a tiny random
model of the pinned transformers' own config class (no download)."""

import os

import pytest
import torch

import mt_grpo_trainer as M
from test_packing import alone, assert_exact, packed, random_group, toy_group, toy_tree, with_losses
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
MOE = {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
PACKED = {  # each family that packs, and what its tiny config sets beyond SIZES
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": MOE,
    "mistral": {"sliding_window": None},  # Mistral-Nemo's; Mistral-7B's window is checked below
    "mixtral": MOE,
    "phi3": {},
    "olmo": {},
    "olmo2": {},
    "olmo3": {},
    "olmoe": MOE,
    "granite": {},
    "granitemoe": MOE,
    "smollm3": {"no_rope_layers": [1, 0]},  # its second layer without rotary positions (NoPE)
    "glm": {},
    "glm4": {},
    "gemma": {},
    "gemma3_text": {},
    "cohere": {},
    "cohere2": {},
    "starcoder2": {},
    "stablelm": {},
    "helium": {},
    "arcee": {},
    "apertus": {},
    "ernie4_5": {},
    "exaone4": {},
    "hunyuan_v1_dense": {},
    "ministral": {},
    "gpt_oss": MOE,  # attention sinks; a 128-token window on every other layer
}
WINDOW = {"sliding_window": 16}  # shorter than the shared prefixes below, so that it decides what a token sees
MIXED = {**WINDOW, "layer_types": ["sliding_attention", "full_attention"]}  # a windowed layer, then a full one
WINDOWED = {  # each family that packs with a sliding window: on every layer, or alternating with full ones
    "qwen2": {"use_sliding_window": True, "max_window_layers": 1, **WINDOW},  # its second layer slides
    "qwen3": {"use_sliding_window": True, "max_window_layers": 1, **WINDOW},
    "qwen3_moe": {"use_sliding_window": True, **WINDOW, **MOE},
    "mistral": WINDOW,
    "mixtral": {**WINDOW, **MOE},
    "phi3": WINDOW,
    "starcoder2": WINDOW,
    "smollm3": {"use_sliding_window": True, **MIXED},
    "gemma3_text": MIXED,
    "cohere2": MIXED,
    "olmo3": MIXED,
    "exaone4": MIXED,
    "ministral": MIXED,
    "gpt_oss": {**MIXED, **MOE},
}
NOT_PACKED = {  # families that train padded: soft-capped attention and windows (gemma2), a classic decoder (gpt2)
    "gemma2": MIXED,
    "gpt2": {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},  # its default dropout is random in training
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


@pytest.mark.parametrize("model_type", list(NOT_PACKED))
def test_a_family_that_does_not_pack_trains_padded_rows_exactly_and_says_so_at_load(model_type, tok, tmp_path, capsys):
    config = tiny_config(model_type, len(tok), **NOT_PACKED[model_type])
    packs, why = M.layout(config)
    assert not packs and why.startswith(f"padded rows: {model_type} "), why
    samples = random_group(len(tok), [3, 70, 7, 40], shared=20)
    assert assert_exact(tiny_model(config), samples) == 0, "padded rows share nothing"
    model_dir = saved_model(config, tok, tmp_path / "model")
    history = M.train(run_cfg(tmp_path, model_dir, "run", "max_steps=1", "save_steps=0"))
    assert len(history) == 1 and history[0]["loss/grad_norm"] > 0, "a step trained"
    assert history[0]["train/shared_prefix_tokens_saved"] == 0
    assert f"[mt-grpo] {why}\n" in capsys.readouterr().out, "the load line names the path and why"


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])
def test_a_family_that_packs_trains_packed_rows_and_says_so_at_load(model_type, tok, tmp_path, capsys):
    """Through train(): qwen3, and gemma3_text with a 16-token window on its first layer."""
    config = tiny_config(model_type, len(tok), **{"qwen3": {}, "gemma3_text": MIXED}[model_type])
    model_dir = saved_model(config, tok, tmp_path / "model")
    history = M.train(run_cfg(tmp_path, model_dir, "run", "max_steps=1", "save_steps=0"))
    assert history[0]["train/shared_prefix_tokens_saved"] > 0, "the group's prompt is held once"
    assert f"[mt-grpo] packed rows: {model_type} is checked exact\n" in capsys.readouterr().out


def test_every_family_that_packs_is_checked_here():
    assert sorted(M.PACKED_MODEL_TYPES) == sorted(PACKED)


@pytest.mark.parametrize("model_type", list(PACKED))
def test_a_family_that_packs_gives_each_samples_own_logprobs_and_gradient(model_type, tok, tmp_path):
    """A group, a branching tree and a long shared prefix, packed, against each sample alone (float32, 1e-5)."""
    config = tiny_config(model_type, len(tok), **PACKED[model_type])
    assert M.layout(config) == (True, f"packed rows: {model_type} is checked exact")
    model = tiny_model(config)
    assert assert_exact(model, toy_group(tok, tmp_path)) > 0, "the group's prompt is held once"
    assert assert_exact(model, toy_tree(tok, tmp_path)) > 0, "a branch's context is held once"
    assert assert_exact(model, random_group(len(tok), [3, 250, 7, 120, 40], shared=20)) > 0


def test_every_family_whose_config_has_a_sliding_window_is_checked_with_one(tok):
    for model_type in M.PACKED_MODEL_TYPES:
        if hasattr(tiny_config(model_type, len(tok), **PACKED[model_type]), "sliding_window"):
            assert model_type in WINDOWED, model_type


@pytest.mark.parametrize("model_type", list(WINDOWED))
def test_a_sliding_window_packs_exactly_with_a_shared_prefix_longer_than_the_window(model_type, tok, tmp_path):
    """A token sees its trie ancestors within the window, counted in depth positions: as each sample alone sees
    its own last tokens. The group's prompt and the shared prefixes are longer than the 16-token window."""
    config = tiny_config(model_type, len(tok), **WINDOWED[model_type])
    assert M.layout(config)[0]
    model = tiny_model(config)
    group = toy_group(tok, tmp_path)
    assert len(os.path.commonprefix([s.input_ids for s in group])) > 16
    assert assert_exact(model, group) > 0
    assert assert_exact(model, toy_tree(tok, tmp_path)) > 0
    assert assert_exact(model, random_group(len(tok), [3, 250, 7, 120, 40], shared=40)) > 0


def test_the_gpu_block_mask_applies_each_layers_window(monkeypatch):
    """A GPU's packed attention, FlexAttention with the trie's block masks (`trie_flex_attention`), forward on the
    CPU: a windowed layer and a full one against each sample alone. FlexAttention runs uncompiled here (forward only):
    the CPU's compiled kernel fails to build for a mask that reads a tensor of depths (an inductor C++ codegen error),
    and it is not what a GPU runs (Triton's); the masks and transformers' handling of them are what is checked."""
    from torch.nn.attention import flex_attention

    import transformers.integrations.flex_attention as hf_flex

    def uncompiled(query, key, value, training=False, **kwargs):
        return flex_attention.flex_attention(query, key, value, **kwargs)

    monkeypatch.setattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    monkeypatch.setattr(hf_flex, "compile_friendly_flex_attention", uncompiled)
    config = tiny_config("gemma3_text", 97, **MIXED)
    samples = random_group(97, [3, 250, 7, 120, 40], shared=40)
    reference = tiny_model(config)
    monkeypatch.setattr(M, "FLEX_DEVICES", {"cpu", "cuda"})
    model = tiny_model(config)
    assert model.config._attn_implementation == "mtgrpo_flex"
    model.load_state_dict(reference.state_dict())
    with torch.no_grad():
        got = packed(model, samples)
        want = alone(reference, samples)
    for lp, ref, s in zip(got, want, samples):
        torch.testing.assert_close(lp * (torch.tensor(s.weights) != 0), ref, rtol=1e-5, atol=1e-5)


def test_attention_sinks_are_computed_as_gpt_oss_computes_them(tok):
    """trie_attention's plain calls (the sampler's, each sample alone) with gpt_oss's sinks, against transformers'
    eager attention for gpt_oss; the packed rows are checked against those calls above."""
    from transformers import AutoModelForCausalLM

    samples = random_group(len(tok), [3, 250, 7, 120, 40], shared=40)
    models = [tiny_model(tiny_config("gpt_oss", len(tok), **WINDOWED["gpt_oss"]))]
    eager = tiny_config("gpt_oss", len(tok), **WINDOWED["gpt_oss"])
    models.append(AutoModelForCausalLM.from_config(eager, attn_implementation="eager"))
    models[1].load_state_dict(models[0].state_dict())
    with torch.no_grad():
        for sink in models[0].model.layers[0].self_attn.sinks, models[1].model.layers[0].self_attn.sinks:
            sink.fill_(1.5)  # a sink that takes a share of every softmax
        got = alone(models[0], samples)
        want = alone(models[1], samples)
    for lp, ref in zip(got, want):
        torch.testing.assert_close(lp, ref, rtol=1e-5, atol=1e-5)


def test_an_moe_that_asks_for_its_routers_aux_loss_trains_padded(tok):
    config = tiny_config("qwen3_moe", len(tok), output_router_logits=True, **MOE)
    packs, why = M.layout(config)
    assert not packs and "aux loss" in why
    assert assert_exact(tiny_model(config), random_group(len(tok), [3, 70, 7, 40], shared=20)) == 0


@pytest.mark.parametrize("model_type", list(PACKED))
def test_lora_adapts_every_linear_layer_but_the_head_and_an_moes_attention_not_its_router_or_experts(
    model_type, tok, tmp_path
):
    """all-linear: adapters on the linear layers (an MoE's router and fused experts are none), they train, and the
    reference (the policy with its adapters off) is the base model still."""
    cfg = M.Config(lora_rank=4, lora_alpha=8, learning_rate=1.0, max_grad_norm=0, beta=0)
    base = tiny_model(tiny_config(model_type, len(tok), **PACKED[model_type]))
    linear = {n for n, m in base.named_modules() if type(m) is torch.nn.Linear and not n.endswith("lm_head")}
    probe = random_group(len(tok), [40], shared=0)
    with torch.no_grad():
        base_logprobs = alone(base, probe)[0]
    model = M.add_lora(base, cfg, str(tmp_path))
    adapted = {
        n.split(".lora_B")[0].removeprefix("base_model.model.") for n, _ in model.named_parameters() if ".lora_B." in n
    }
    assert adapted == linear and any("self_attn" in n for n in adapted)
    assert not [n for n in adapted if "expert" in n or "router" in n or n.endswith("mlp.gate")], "no router, no experts"
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    samples = with_losses(random_group(len(tok), [30, 25, 40], shared=10))
    M.train_on_samples(model, None, opt, sched, samples, cfg, 0)
    moved = {
        n.split(".lora_B")[0].removeprefix("base_model.model.")
        for n, p in model.named_parameters()
        if ".lora_B." in n and not p.equal(before[n])
    }
    assert moved == adapted, "every adapter trained"
    with torch.no_grad(), model.disable_adapter():
        torch.testing.assert_close(alone(model, probe)[0], base_logprobs, rtol=0, atol=0)
    with torch.no_grad():
        assert not torch.equal(alone(model, probe)[0], base_logprobs), "the policy moved"

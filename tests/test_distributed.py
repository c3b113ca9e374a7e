"""torchrun on CPU with 2 gloo ranks: the same update as one process (also with KL, sequence_mean and gradient
clipping), end-to-end training, and a failing rank that stops every rank."""

import os
import subprocess
import sys
import time

import pytest
import torch

import mt_grpo_trainer as M
from tests.dist_worker import update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(args, timeout=240, env=None):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(M.free_port()),
        *args,
    ]
    return subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )


def assert_same_update(two: dict, one_sd: dict, one_m: dict, model_dir: str, lora: bool = False, label: str = ""):
    """2 ranks' weights and loss equal one process's, and the update moved the weights (or it proves nothing)."""
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert set(two["state"]) == set(one_sd) and all(("lora_" in k) == lora for k in one_sd), (
        f"{label}: LoRA's are the adapters' tensors alone, from every layout"
    )
    moved = 0.0
    for k, v in one_sd.items():
        torch.testing.assert_close(two["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label} {k}: {m}")
        moved = max(
            moved, (v - before[k]).abs().max().item() if k in before else v.abs().max().item() * ("lora_B" in k)
        )
    assert moved > 1e-3, f"{label}: the update did nothing, so the comparison proves nothing"
    assert two["metrics"]["loss/policy"] == pytest.approx(one_m["loss/policy"], rel=1e-5, abs=1e-7), label


LAYOUTS = [  # (layout, max_tokens_per_microbatch): 0 is one micro-batch of micro_batch_size samples
    ("ddp", 0),
    ("ddp", 90),
    ("fsdp", 0),
    ("fsdp", 90),
    ("fsdp+checkpointing", 90),
    ("ddp+lora", 0),
    ("fsdp+lora+checkpointing", 90),
]


def layout_overrides(layout: str, budget: int) -> list[str]:
    """The recipe keys of one layout, as the one-process update takes them (which has no fsdp)."""
    lora = ["lora_rank=4", "lora_target_modules=[q_proj,up_proj]"] if "lora" in layout else []
    return [f"max_tokens_per_microbatch={budget}", "micro_batch_size=3", *lora]


def test_two_ranks_give_the_update_of_one_in_every_layout(tiny_model_dir, tmp_path):
    """One launch runs every layout, each on a freshly loaded model: a launch costs seconds, a tiny model's update
    does not."""
    sets = []
    for layout, budget in LAYOUTS:
        fsdp = f"fsdp={'true' if layout.startswith('fsdp') else 'false'}"
        checkpointing = f"gradient_checkpointing={'true' if 'checkpointing' in layout else 'false'}"
        sets.append(" ".join([fsdp, checkpointing, *layout_overrides(layout, budget)]))
    r = torchrun(["tests/dist_worker.py", tiny_model_dir, str(tmp_path / "two.pt"), *" :: ".join(sets).split()])
    assert r.returncode == 0, r.stderr[-3000:]
    for (layout, budget), two in zip(LAYOUTS, torch.load(tmp_path / "two.pt"), strict=True):
        one_sd, one_m = update(tiny_model_dir, ["fsdp=false", *layout_overrides(layout, budget)])
        assert_same_update(
            two, one_sd, one_m, tiny_model_dir, lora="lora" in layout, label=f"{layout}, budget {budget}"
        )


# What the cross-rank sums must get right besides the policy term: the KL (beta > 0, with a second iteration so that
# the policy has left the reference), sequence_mean's episode count (episode 0, on rank 0, has two samples), and
# gradient clipping (max_grad_norm below the batch's gradient norm, about 0.06).
VARIANTS = {
    "kl": ["beta=1.0", "num_iterations=2"],
    "sequence_mean": ["loss_aggregation=sequence_mean"],
    "clipped": ["max_grad_norm=0.02"],
}


def test_two_ranks_give_the_update_of_one_with_kl_sequence_mean_and_clipping(tiny_model_dir, tmp_path):
    """One launch runs each variant under DDP and under FSDP: a launch costs seconds, a tiny model's update does not."""
    runs = [(name, fsdp) for fsdp in ("false", "true") for name in VARIANTS]
    common = ["micro_batch_size=3", "max_tokens_per_microbatch=90"]
    sets = [" ".join([f"fsdp={fsdp}", *common, *VARIANTS[name]]) for name, fsdp in runs]
    r = torchrun(["tests/dist_worker.py", tiny_model_dir, str(tmp_path / "two.pt"), *" :: ".join(sets).split()])
    assert r.returncode == 0, r.stderr[-3000:]
    for name in VARIANTS:
        one_sd, one_m = update(tiny_model_dir, ["fsdp=false", *common, *VARIANTS[name]])
        for (n, fsdp), two in zip(runs, torch.load(tmp_path / "two.pt")):
            if n == name:
                assert_same_update(two, one_sd, one_m, tiny_model_dir)
                for k in ("loss/kl", "loss/grad_norm"):
                    assert two["metrics"][k] == pytest.approx(one_m[k], rel=1e-5, abs=1e-9), f"{name}, fsdp={fsdp}: {k}"
        if name == "kl":
            assert one_m["loss/kl"] > 1e-4, "the policy never left the reference, so the KL term did nothing"
        if name == "clipped":
            assert one_m["loss/grad_norm"] > 0.02, "the gradient was never clipped"


def test_token_budget_fills_micro_batches_with_packed_rows_longest_first():
    rows = [{"ids": [0] * n} for n in (5, 48, 7, 50, 6, 20, 22, 49)]
    mbs = M.make_microbatches(rows, 100)
    assert [[len(row["ids"]) for row in mb] for mb in mbs] == [[50, 49], [48, 22], [20, 7, 6, 5]]
    for mb in mbs:
        assert len(mb) * max(len(row["ids"]) for row in mb) <= 100 or len(mb) == 1


def _recipe_args(tiny_model_dir, run_dir, *extra):
    return [
        "mt_grpo_trainer.py",
        "hf_recipes/toy/toy-kv--mt-grpo.yaml",
        f"model_name_or_path={tiny_model_dir}",
        "model_builder=",
        f"output_dir={run_dir}",
        "max_steps=2",
        "prompts_per_step=2",
        "num_generations=2",
        "max_tokens=16",
        "log_episodes_steps=1",
        "save_steps=1",
        "max_tokens_per_microbatch=256",
        "eval_steps=0",
        *extra,
    ]


def test_torchrun_trains_end_to_end_with_rank0_logging(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    r = torchrun(_recipe_args(tiny_model_dir, run))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2, "rank 0 alone writes one metrics line per step"
    eps = [__import__("json").loads(x) for x in (run / "episodes.jsonl").read_text().splitlines()]
    assert sorted({e["episode"] for e in eps if e["step"] == 1}) == [0, 1, 2, 3], "both ranks' episodes are dumped"
    assert (run / "checkpoint-2" / "trainer_state.pt").is_file()
    assert "train/row_fill" in lines[-1] and "train/shared_prefix_tokens_saved" in lines[-1]


def test_an_exception_on_one_rank_ends_every_rank(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad_reward.py"
    bad.write_text(
        "import os\n\ndef reward(completions, **kw):\n"
        "    if os.environ.get('RANK') == '1':\n        raise RuntimeError('reward exploded on rank 1')\n"
        "    return [0.0] * len(completions)\n"
    )
    t = time.time()
    r = torchrun(
        _recipe_args(
            tiny_model_dir, tmp_path / "run", f"outcome_reward_funcs=[{bad}:reward]", "distributed_timeout=60"
        ),
        timeout=200,
    )
    assert r.returncode != 0
    assert "reward exploded on rank 1" in r.stderr
    assert time.time() - t < 150, "the healthy rank must not wait out the collective timeout"


def test_prompts_must_split_into_whole_groups_per_rank(tiny_model_dir, tmp_path):
    r = torchrun(_recipe_args(tiny_model_dir, tmp_path / "run", "prompts_per_step=3"), timeout=120)
    assert r.returncode != 0
    assert "prompts_per_step=3 must be a multiple of the 2 training ranks" in r.stderr

"""Every bench in bench/ runs, at a smoke size, through its own command line (issue 44). A bench reads the trainer's
functions, metrics and recipe keys; when they change, the bench fails here rather than at its next measurement.

Each case runs the bench as a user does (a subprocess, small arguments), writes only under tmp_path, and must print its
result lines. No figure is asserted: at these sizes the figures mean nothing. The toy model is the tests' own
(toy_model_dir); recipes of other tasks run it too (their tokenizer's text is encoded by its byte-level BPE), which
keeps their warm starts out of the suite. Benches that need the real vLLM CPU server share one, started once."""

import os
import re
import shlex
import subprocess
import sys

import pytest

import mt_grpo_trainer as M
from conftest import ROOT, recipe_cfg, start_real_server, stop_real_server, vllm_cpu_venv

BENCH = os.path.join(ROOT, "bench")
LIBRARIES = {  # modules the benches import, with no command line of their own
    "paired_stats.py": "the paired tests of bench/turn_credit.py, bench/paper_effect.py and bench/agent_harness.py",
    "seed_runs.py": "the training workers of bench/turn_credit.py, bench/paper_effect.py and bench/agent_harness.py",
}
TOY = "model_name_or_path={toy} model_builder="
SMALL = "prompts_per_step=1 num_generations=2"
FEW_EVALS = "eval_max_examples=2 eval_samples=1"
TOY_KV = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
NUM = r"[-+\d.]+"  # a printed figure

# bench -> its runs, each (its arguments, a line it must print: a regex over its stdout, one line). The arguments are
# pieces of a command line (shell quoting); in them {tmp} is the run's folder under tmp_path, {toy} the toy model's
# folder, {url} the shared vLLM server's.
SMOKE = {
    "agent_harness.py": [
        (
            ["--part overhead --repeats 1 --out {tmp} --set", TOY, SMALL],
            rf"^\| \*\*the endpoint's own cost\*\* \(wall: to the reply sent\) \| \*\*{NUM} / {NUM}\*\* \| \*\*{NUM} / {NUM}\*\* \|$",
        ),
        (
            ["--part learning --seeds 0 --steps 1 --jobs 1 --out {tmp} --set", TOY, SMALL],
            rf"^harness - built-in, outcome over the last 10 steps: mean {NUM}, 95% CI \[{NUM}, {NUM}\]",
        ),
    ],
    "async_overlap.py": [
        (
            ["--part filter --seeds 0 --steps 1 --out {tmp} --set", TOY, SMALL],
            rf"^\| true \| not reached \(\d+\) \| {NUM} \| {NUM} \|$",
        )
    ],
    "branching_server.py": [
        (
            ["--steps 2 --out {tmp} --server-url {url} --set", TOY, "prompts_per_step=1"],
            r"^\| tree \(b 2, depth 3, 32 leaves\) \| \d+ \| \d+ \| [\d.]+ \| \S+ \| [\d.]+ \|$",
        )
    ],
    "code_density.py": [
        (["mt_grpo_trainer.py"], r"^\| mt_grpo_trainer.py, read path \| [\d,]+ \| [\d,]+ \| [\d.]+ \|")
    ],
    "credit_at_equal_tokens.py": [
        (
            ["--seeds 0 --max-steps 1 --eval-every 1 --jobs 1 --methods state tree --out {tmp} --set", TOY, FEW_EVALS],
            r"^state-matched \(G 12\) > tree \(16 leaves\): \d+ of 1 seeds, p = ",
        ),
        (
            ["--noisy --seeds 0 --max-steps 1 --eval-every 1 --jobs 1 --out {tmp} --set", TOY, FEW_EVALS],
            r"^state-matched \(G 12\) > MT-GRPO \(G 12\): \d+ of 1 seeds, p = ",
        ),
    ],
    "credit_snr.py": [(["--draws 20 --exact 20"], r"^\d+ s wall, \d+ s of CPU$")],
    "gpu_step.py": [  # its CPU smoke mode, on a small shape with the toy's tokenizer
        (
            [
                "--tokenizer {toy} --layers 1 --seq 64 --samples 4 --mb-tokens 256 --steps 1",
                "--cases full lora,padded logprobs --out {tmp}/results.json",
                "--config vocab_size=512 hidden_size=64 intermediate_size=128 num_attention_heads=2",
                "num_key_value_heads=1 head_dim=32",
            ],
            r'^\[bench\] \{"case": "logprobs", "chunked": .*"max_abs_diff": ',
        ),
        (
            [
                "--tokenizer {toy} --family qwen3_moe --layers 1 --seq 64 --samples 4 --mb-tokens 256 --steps 1",
                "--cases full exact --profile --exact-families mistral --config vocab_size=512 hidden_size=64",
                "intermediate_size=128 num_attention_heads=2 num_key_value_heads=1 head_dim=32",
                "moe_intermediate_size=32 num_experts=4 num_experts_per_tok=2",
            ],
            r'^\[bench\] \{"case": "exact", "families": \{"mistral": \{"attention": "mtgrpo_trie", .*"exact": true\}\}\}',
        ),
    ],
    "logprob_memory.py": [(["--lengths 32 --batch 1 --layers 1 --precision fp32"], r"^\| fp32 \| 32 \| 32 \| \d+ \|")],
    "long_episodes.py": [(["--turns 2"], r"^\| 2 \| fork \(0\) \| \d+ \| \d+ \| \d+ \| \d+ \|$")],
    "long_episodes_server.py": [
        (
            ["--model {toy} --server-url {url} --turns 2 --max-seq-len 512 --out {tmp}"],
            r"^mean tokens per episode \d+; episodes of one sample: \d+/\d+$",
        )
    ],
    "lora_vs_full.py": [
        (
            [TOY_KV, "--steps 1 --out {tmp} --server-url {url} --set", TOY, SMALL],
            rf"^\| full \| {NUM} \| {NUM} \| {NUM} \| not reached \| {NUM} \|$",
        )
    ],
    "merged_vs_per_turn.py": [([], rf"^\| user turns \| 16 \| all \| \d+ \| \d+ \| \d+ \| {NUM}x \|$")],
    "packing.py": [
        (
            ["--cases toy tree --repeats 1 --out {tmp} --set", TOY, "prompts_per_step=1"],
            rf"^tree \(b 2, depth 3\): processed/trained {NUM} packed vs {NUM} padded; step time {NUM}x",
        )
    ],
    "paper_effect.py": [
        (
            ["--seeds 0 --max-steps 1 --eval-every 1 --jobs 1 --out {tmp} --set", TOY, SMALL, FEW_EVALS],
            r"^MT-GRPO > GRPO-MR: \d+ of 1 seeds, p = ",
        )
    ],
    "real_model.py": [
        (
            ["--steps 1 --eval-steps 1 --methods MT-GRPO --server-url {url} --out {tmp} --set", TOY, SMALL, FEW_EVALS],
            r"^runs that learned: \d of 1$",
        )
    ],
    "rollout_throughput.py": [
        (["--episodes 16 --latency 0.05 --seq-episodes 1"], rf"^\| ours \| {NUM} \| {NUM}x \| {NUM}% \|$")
    ],
    "server_vs_local.py": [
        (
            [TOY_KV, "--steps 1 --out {tmp} --server-url {url}", TOY, SMALL, "eval_steps=0"],
            rf"^server step time / local step time: {NUM}x$",
        )
    ],
    "several_servers.py": [
        (["--part standin --latency 0.01 --servers 1 2 --prompts 2"], rf"^\| 2 \| {NUM} \| {NUM} \| {NUM}x \|$")
    ],
    "sync_check.py": [
        (
            ["--lrs 1e-4 --kinds 'partial, noise 1e-3' --steps 2 --out {tmp} --model {toy} --server-url {url}"],
            r"^\| 0.0001 \| 0 \| partial, noise 1e-3 \| \d+/\d+ \|",
        )
    ],
    "toy_modes.py": [
        (
            ["--seeds 0 --max-steps 1 --out {tmp} --set", TOY, SMALL, "eval_steps=0"],
            r"^\| GRPO-MR \(`grpo_merged`\) \| (\d+|not reached) \|",
        )
    ],
    "turn_credit.py": [
        (
            ["--seeds 0 --max-steps 1 --eval-every 1 --jobs 1 --out {tmp} --set", TOY, "prompts_per_step=1", FEW_EVALS],
            r"^MT-GRPO > GRPO-OR: \d+ of 1 seeds, p = ",
        )
    ],
    "vllm_families.py": [(["--families mistral --out {tmp}"], r"^served: \d of 1 families \(")],
    "weight_sync.py": [(["--sizes 25 --repeats 1 --dir {tmp}"], rf"^\| \d+M \| {NUM} GB \| {NUM} \|")],
}


def uses(name: str, what: str) -> bool:
    """Whether bench `name`'s smoke runs name `what` ({toy}, {url}) in their arguments."""
    return any(what in piece for args, _ in SMOKE.get(name, []) for piece in args)


# The benches that share the server run last, so that it starts late and does not idle beside the others.
NAMES = sorted((f for f in os.listdir(BENCH) if f.endswith(".py")), key=lambda f: (uses(f, "{url}"), f))


@pytest.fixture(scope="module")
def server(toy_model_dir, tmp_path_factory):
    """vLLM's CPU build serving the toy model (`bash run.sh serve`), with LoRA enabled for bench/lora_vs_full.py."""
    srv = start_real_server(toy_model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log", "lora_rank=8")
    yield srv
    stop_real_server(srv.proc)


def as_built(srv, tmp_path):
    """The server holds the toy model's weights as built again, through the trainer's own sync: a bench before may have
    trained them, and bench/lora_vs_full.py's LoRA run syncs only its adapter, onto the base it finds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(srv.model_dir)
    cfg = recipe_cfg(tmp_path, f"vllm_server_url={srv.url}", f"weight_sync_dir={tmp_path}/sync")
    client = M.VLLMServerClient(cfg, model.config.vocab_size, say=lambda *_: None)
    client.sync_weights(model, model.state_dict(), 0)
    client.close()


def written_in_bench() -> set[str]:
    """The files under bench/ (but bytecode): where a bench writes by default."""
    return {
        os.path.join(d, f) for d, dirs, files in os.walk(BENCH) if "__pycache__" not in d.split(os.sep) for f in files
    }


@pytest.mark.parametrize("name", NAMES)
def test_each_bench_runs_at_a_smoke_size(name, tmp_path, request):
    source = open(os.path.join(BENCH, name)).read()
    if name in LIBRARIES:
        assert "__main__" not in source, f"bench/{name} has a command line now: give it a smoke case in SMOKE"
        return
    assert name in SMOKE, f"bench/{name} has no smoke case: add one to SMOKE in tests/test_benches.py"
    values = {}
    if uses(name, "{toy}"):
        values["toy"] = request.getfixturevalue("toy_model_dir")
    if uses(name, "{url}"):
        srv = request.getfixturevalue("server")
        as_built(srv, tmp_path / "as_built")
        values["url"] = srv.url
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",  # the suite's other worker has the other core
        "MTGRPO_VENV": os.path.dirname(os.path.dirname(sys.executable)),
        "MTGRPO_REQUIREMENTS": "requirements.txt",
        "MTGRPO_VLLM_VENV": vllm_cpu_venv(),
    }
    before = written_in_bench()
    for k, (args, printed) in enumerate(SMOKE[name]):
        values["tmp"] = str(tmp_path / f"run{k}")
        os.makedirs(values["tmp"])
        argv = [arg.format(**values) for piece in args for arg in shlex.split(piece)]
        cmd = [sys.executable, os.path.join(BENCH, name), *argv]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)  # 1200: a hang
        said = f"bench/{name} {' '.join(argv)}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert r.returncode == 0, said
        assert re.search(printed, r.stdout, re.M), f"no line matches {printed!r}:\n{said}"
    assert written_in_bench() == before, f"bench/{name} wrote under bench/: {written_in_bench() - before}"

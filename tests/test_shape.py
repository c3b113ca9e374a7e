"""The trainer reads in one sitting: its size, its order, its longest function, and that it stands alone."""

import ast
import os
import inspect
import re

import mt_grpo_trainer as M
from bench import code_density

SOURCE = inspect.getsource(M)
LINES = SOURCE.splitlines()
# The whole file's code tokens: what it had when the line cap was retired, and what each feature since added. A feature
# that adds code adds its line here, naming itself; a simplification lowers the first.
FEATURE_TOKENS = {
    "the trainer at be8dc43 (the 3,139-line cap retired)": 26_710,
    "credit decided per node, a zero-spread guard for leave-one-out, scale_returns (issue 32)": 224,
    "saves that say what was saved, a failed save in one line, a token for servers other hosts reach (issue 32)": 72,
    "paths beside the recipe, a run folder per override, the lock released, curves.png, the no-gradient note (issue 33)": 984,
    "a sync check that judges the slope of the server's change on the trainer's, one probe a sync (issues 32, 38)": 209,
    "packed rows with shared prefixes merged into a trie, trie attention on the CPU and FlexAttention on a GPU (issue 36)": 1_292,
    "sampled, seeded evaluation (eval_temperature, eval_samples) and an evaluation at step 0 (issues 33, 34)": 259,
    "the method's read path one idea per line: named groups and values, keyword calls, one step seed, wrapped key docstrings (issue 35)": 140,
    "runs started together build a missing model once (a lock beside it), one place that says which devices use FlexAttention": 86,
    "agent harnesses: an OpenAI-compatible endpoint per episode whose requests are the environment's turns, replayed to branch (issue 37)": 3_795,
    "the evaluation at step 0 a row of metrics.jsonl, which the summary compares with the last (issue 44)": 130,
    "sync_check: false turns the weight-sync probe off, for a server without prompt_logprobs (issue 44)": 40,
    "a recipe or command not found named with the nearest, a .py recipe's plug-ins named, eval auto with no checkpoint stops, plug-ins import their siblings, no empty eval/, a closed pipe, a truncated agent turn is length (issues 45, 47)": 492,
    "the agent endpoint streams, and serves the Responses API, its bodies built and checked with the openai package's types (issue 47)": 2_028,
    "any causal LM trains: padded rows (one sample a row) for a family not checked exact packed, a line at load says which (issue 46)": 185,
    "24 families checked exact in packed rows, an MoE's aux loss keeps it padded, LoRA's all-linear the same in every family (issue 46)": 90,
    "sliding windows in the trie mask, in depth positions, on the CPU and in FlexAttention's block masks: 30 families pack (issue 46)": 278,
    "attention sinks (gpt_oss) on the CPU, in packed rows and plain calls: one more key per head, scored by its sink (issue 46)": 342,
    "a state-matched baseline (advantage_mode state_matched), each turn's state a digest of its prompt, adv/state_match_* (issue 48)": 537,
    "the bridge steps aside for a template that refuses its stub (Gemma without a system message; issue 46)": 17,
    "`show` beside plot, and report.html written at a run's end, named by the summary's last line (issue 45)": 48,
    "forks by cause: rollout/forks_harness_edit and rollout/forks_template (issue 47)": 57,
    "harnesses out of the trainer's process: agent_processes (worker processes), agent_command (a process per episode), each ended with its process group (issue 47)": 1_391,
    "the run says why it is not learning: tool shares and error rate, groups without spread, a tool-choice alarm, reasons and failing episodes at the end (issue 45)": 862,
    "build_report.json records what built a model (its builder, the sources it imports, its system prompt); a changed builder stops the run (issue 45)": 598,
    "worker pools start threads as calls come and let them go when idle: no threads pile up across runs in one process": 160,
    "the agent endpoint writes a reply's headers and body at once: no wait for the interpreter lock between them (issue 47)": 5,
    "a harness request whose fields are of other types, or that the chat template refuses, is its 400, not a stopped run (issue 47)": 183,
    "harness workers run the code the trainer imported, and a rollout whose every agent episode failed stops in one line (issue 47)": 28,
}
APPENDIX = next(i for i, line in enumerate(LINES) if line.startswith("# APPENDIX: plumbing"))


def test_the_read_path_stays_short_and_code_tokens_grow_only_with_features():
    # The read path in lines as `ruff format` lays them out; the whole file in code tokens (bench/code_density.py), so
    # splitting a line changes nothing and packing one saves nothing: a budget is met by removing code.
    assert APPENDIX < 1500, f"the read path (before the appendix) is {APPENDIX} lines; its budget is 1,500"
    tokens = code_density.measure(SOURCE)["code_tokens"]
    budget = sum(FEATURE_TOKENS.values())
    assert tokens <= budget, (
        f"mt_grpo_trainer.py has {tokens:,} code tokens, over its {budget:,}: simplify, or add a feature's line to FEATURE_TOKENS"
    )


def test_no_function_is_too_long_and_train_is_the_loop():
    long = [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(ast.parse(SOURCE))
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 60
    ]
    assert long == [], f"functions over 60 lines: {long}"
    body = inspect.getsource(M.train)
    for step in ("rollout", "update", "sync", "log", "save"):
        assert re.search(rf"# \d(-\d)?\. .*{step}", body), f"train() does not show the '{step}' step"


def test_sections_come_in_the_reading_order_and_plumbing_after_the_appendix_banner():
    banners = [line for line in LINES if line.startswith("# === ")]
    titles = [re.sub(r"^# === [\w.]+ ?", "", b).split(":")[0].rstrip(" =") for b in banners]
    assert titles[:8] == [
        "Config",
        "Data types",
        "The method, as pure functions",
        "Tool formats",
        "The environment",
        "The train step",
        "The training loop",
        "CLI",
    ], titles
    where = {
        name: LINES.index(next(line for line in LINES if re.match(rf"{kind} {name}\b[(:]", line)))
        for kind, name in [
            ("def", "score"),
            ("def", "assign_advantages"),
            ("def", "grpo_loss"),
            ("def", "train"),
            ("class", "VLLMServerClient"),
            ("def", "save_checkpoint"),
            ("class", "MetricsLogger"),
            ("def", "load_config"),
        ]
    }
    assert where["score"] < where["assign_advantages"] < where["grpo_loss"] < where["train"] < APPENDIX
    assert all(where[k] > APPENDIX for k in ("VLLMServerClient", "save_checkpoint", "MetricsLogger", "load_config"))


def test_the_file_stands_alone():
    header = M.__doc__
    for i in range(1, 7):
        assert re.search(rf"^  I{i} \w", header, re.M), f"the header does not define I{i}"
    assert os.path.join("..", "shared") not in SOURCE and "DESIGN.md" not in SOURCE and "STYLE.md" not in SOURCE
    assert "Worked example" in M.MultiTurnToolEnv.next_prompt.__doc__


def test_every_mutation_names_code_that_is_there():
    """tests/mutations.py's snippets follow the code: one that moved would be reported stale only when it is run."""
    from tests.mutations import MUTATIONS, ROOT

    for m in MUTATIONS:
        with open(f"{ROOT}/{m.file}") as f:
            assert f.read().count(m.old) == 1, f"mutation {m.name!r}: its snippet is not in {m.file} exactly once"

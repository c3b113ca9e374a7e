"""Config and what a recipe names. Recipe keys map 1:1 to the dataclass and overrides work; an unknown key, a wrong
type, a value out of its range, a key written twice or text that is not valid YAML stops the run before anything
runs, in one line naming it. What a recipe names fails at load in one line naming the file (and line): a plug-in
that is missing, fails on import or could only fail later (async def, a generator, not callable, a name used
twice), a dataset file or function, a prompt of the wrong shape, a model that cannot be loaded. The docs made
from Config are current, and every relative link in the docs resolves. (The shipped recipes: test_recipes.py.)"""

import dataclasses
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import mt_grpo_trainer as M
from conftest import TOY, cli, main_error, one_line_error, toy_error


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


def test_unknown_key_names_the_key_and_the_closest_valid_one(tmp_path):
    with pytest.raises(
        M.ConfigError, match=r"unknown config key 'learning_rte' in .*r\.yaml; did you mean 'learning_rate'"
    ):
        M.load_config(write(tmp_path, "learning_rte: 1.0e-5\n"))
    override = r"unknown config key 'num_generation' in the override 'num_generation=4' on the command line; did you"
    with pytest.raises(M.ConfigError, match=override + r" mean 'num_generations'"):
        M.load_config(None, ["num_generation=4"])
    with pytest.raises(M.ConfigError, match=override):  # a typo on the command line is not the recipe's
        M.load_config(write(tmp_path, "seed: 1\n"), ["num_generation=4"])


@pytest.mark.parametrize(
    "text,err",
    [
        ("max_steps: ten\n", "'max_steps' must be int, got str"),
        ("max_steps: 2.5\n", "'max_steps' must be int, got float"),
        ("scale_rewards: 1\n", "'scale_rewards' must be bool"),
        ("tools: tools/kv_lookup.py:lookup\n", "'tools' must be a list"),
        ("turn_reward_weights: [1, x]\n", r"'turn_reward_weights\[1\]' must be float"),
        ("advantage_mode: ppo\n", "'advantage_mode' must be one of mt_grpo, mt_grpo_merged_fallback, grpo_outcome"),
        (
            "outcome_reward_weights: [1.0, 2.0]\n",
            "'outcome_reward_weights' has 2 entries but 'outcome_reward_funcs' has 1",
        ),
        ("num_generations: 1\n", "num_generations must be >= 2"),
        ("- a\n- b\n", "must be a YAML mapping"),
    ],
)
def test_wrong_types_and_values_fail(tmp_path, text, err):
    with pytest.raises(M.ConfigError, match=err):
        M.load_config(write(tmp_path, text))


def test_overrides_and_float_strings(tmp_path):
    cfg = M.load_config(
        write(tmp_path, "learning_rate: 1e-5\nmax_steps: 3\n"),
        ["max_steps=7", "beta=0.04", "tools=[a.py:f, b.py:g]", "report_to=wandb", "output_dir=/tmp/x"],
    )
    assert cfg.learning_rate == 1e-5  # YAML reads 1e-5 as a string; a float field accepts it
    assert cfg.max_steps == 7 and cfg.beta == 0.04 and cfg.tools == ["a.py:f", "b.py:g"] and cfg.report_to == "wandb"
    assert M.load_config(write(tmp_path, "seed: 1\n")).output_dir == "runs/r"  # default: runs/<recipe name>
    with pytest.raises(M.ConfigError, match="must look like key=value"):
        M.load_config(None, ["max_steps"])


def test_yaml_off_and_no_stay_strings_and_string_overrides_stay_verbatim(tmp_path):
    cfg = M.load_config(
        write(tmp_path, "tokenization_check: off\nmixed_precision: no\nscale_rewards: false\n"),
        ["system_prompt=Answer: briefly", "wandb_project=2025"],
    )
    assert (cfg.tokenization_check, cfg.mixed_precision, cfg.scale_rewards) == ("off", "no", False)
    assert cfg.system_prompt == "Answer: briefly" and cfg.wandb_project == "2025"


def test_every_field_has_a_default_and_a_docstring():
    docs = M.field_docs()
    for f in dataclasses.fields(M.Config):
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
        assert docs.get(f.name, "").strip(), f"Config.{f.name} has no docstring"


@pytest.mark.parametrize(
    "override,message",
    [
        ("temperature=0", "temperature must be in (0, 2], got 0"),
        ("temperature=-1", "temperature must be in (0, 2]"),
        ("epsilon=-0.1", "epsilon must be in [0, 1], got -0.1"),
        ("max_steps=-1", "max_steps must be >= 1, got -1"),
        ("top_p=0", "top_p must be in (0, 1], got 0"),
        ("prompts_per_step=0", "prompts_per_step must be >= 1, got 0"),
        ("learning_rate=nan", "learning_rate must be > 0, got 'nan'"),
        ("learning_rate=inf", "learning_rate must be > 0"),
        ("adam_betas=[0.9, 1.0]", "adam_betas must be in [0, 1)"),
        ("vllm_gpu_memory_utilization=1.5", "must be in (0, 1]"),
    ],
)
def test_values_out_of_range_fail_before_anything_runs(tmp_path, override, message):
    r = cli(TOY, override, f"output_dir={tmp_path}/run")
    one_line_error(r, message)
    assert not (tmp_path / "run").exists(), "nothing was written: not even config.yaml"


def test_every_numeric_key_has_its_range_every_variant_key_its_choices_and_help_shows_them():
    import typing

    rules, hints = M.field_rules(), typing.get_type_hints(M.Config)
    numeric = [k for k, t in hints.items() if t in (int, float, list[float])]
    assert sorted(k for k, r in rules.items() if isinstance(r, str)) == sorted(numeric)
    choices = {k: r for k, r in rules.items() if isinstance(r, tuple)}
    assert choices["advantage_mode"] == tuple(M.ADVANTAGE_MODES) and choices["tool_format"] == tuple(M.TOOL_FORMATS)
    for name, default in dataclasses.asdict(M.Config()).items():  # every default follows its own rule
        if name in choices:
            assert default in choices[name], name
        elif name in rules:
            assert all(M.in_range(x, rules[name]) for x in np.atleast_1d(default)), name
    h = cli("--help")
    assert "temperature (float, default 1.0, range (0, 2])" in h.stdout
    assert "lr_scheduler (str, default 'constant'; one of constant, linear, cosine)" in h.stdout


def test_a_key_written_twice_is_an_error_naming_both_lines(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(open(TOY).read() + "learning_rate: 1.0e-2\n")
    first = next(i for i, x in enumerate(open(TOY).read().splitlines()) if x.startswith("learning_rate:")) + 1
    last = len(recipe.read_text().splitlines())
    with pytest.raises(
        M.ConfigError, match=f"recipe key 'learning_rate' is set twice, on lines {first} and {last} of {recipe}"
    ):
        M.load_config(str(recipe))


@pytest.mark.parametrize(
    "recipe,override,needles",
    [
        (
            b"max_steps: 3\nsystem_prompt: Answer: briefly\n",
            None,
            ["r.yaml, line 2, column 22: not valid YAML: mapping values are not allowed here", "quote values"],
        ),
        (b"tools: [tools/kv_lookup.py:lookup\nseed: 1\n", None, ["r.yaml, line 2, column 5:", "from line 1, column 8"]),
        (
            b"seed: 1\nsystem_prompt: caf\xe9\n",
            None,
            ["r.yaml, position 26: not valid YAML: invalid continuation byte", "save it as UTF-8"],
        ),
        (
            b"seed: 1\n",
            "tools=[tools/kv_lookup.py:lookup",
            ["the value of override 'tools=[tools/kv_lookup.py:lookup', line 1, column 27: not valid YAML"],
        ),
    ],
)
def test_a_recipe_or_override_that_is_not_valid_yaml_is_one_line_naming_the_line(
    tmp_path, capsys, recipe, override, needles
):
    (tmp_path / "r.yaml").write_bytes(recipe)
    err = main_error(capsys, str(tmp_path / "r.yaml"), *[override] * bool(override))
    assert all(n in err for n in needles), err


def test_cli_reports_config_errors_without_a_traceback():
    r = subprocess.run(
        [sys.executable, "mt_grpo_trainer.py", "hf_recipes/toy/toy-kv--mt-grpo.yaml", "bogus_key=1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "unknown config key 'bogus_key'" in r.stderr and "Traceback" not in r.stderr
    h = subprocess.run([sys.executable, "mt_grpo_trainer.py", "--help"], capture_output=True, text=True, timeout=120)
    assert (
        h.returncode == 0 and "turn_advantage_coef" in h.stdout and "lambda: weight of the turn advantage" in h.stdout
    )


@pytest.mark.parametrize(
    "argv,needles",
    [
        (["evl"], ["recipe not found: evl (did you mean 'eval'?)", "Commands: train, eval, check-template"]),
        (["eval", "hf_recipes/toy/toy-kv--mt-grp.yaml"], ["(did you mean 'hf_recipes/toy/toy-kv--mt-grpo.yaml'?)"]),
        (["tasks/toy_kv_agent.py"], ["a recipe is a YAML file", "'agent: tasks/toy_kv_agent.py:agent'"]),
        (["rewards/toy_kv_reward.py"], ["'outcome_reward_funcs: [rewards/toy_kv_reward.py:exact_answer_reward]'"]),
    ],
)
def test_a_mistyped_command_or_recipe_gets_the_commands_and_the_nearest_and_a_py_gets_how_to_name_it(
    capsys, argv, needles
):
    err = main_error(capsys, *argv)
    assert all(n in err for n in needles), err


def test_help_into_a_pipe_its_reader_closed_ends_without_a_traceback():
    p = subprocess.Popen(
        [sys.executable, "mt_grpo_trainer.py", "--help"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    p.stdout.close()  # as `| head` does once it has its lines; here before the first one (the import takes seconds)
    err = p.stderr.read()
    p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_missing_plugin_file_and_function_are_named():
    with pytest.raises(M.ConfigError, match="reward file not found: 'rewards/nope.py'"):
        M.load_object("rewards/nope.py:f", "reward")
    with pytest.raises(M.ConfigError, match="reward 'nope' not found in rewards/toy_kv_reward.py"):
        M.load_object("rewards/toy_kv_reward.py:nope", "reward")


@pytest.mark.parametrize(
    "source,needles",
    [
        (
            "X = 1\ndef f(:\n    pass\n",
            ["tool file '{p}' failed on import: SyntaxError: invalid syntax (plugin.py, line 2); fix it"],
        ),
        (
            "import json\nimport no_such_module_for_mt_grpo\n",
            [
                "ModuleNotFoundError: No module named 'no_such_module_for_mt_grpo' ({p}, line 2); install the missing package"
            ],
        ),
        (
            "import json\ndef setup():\n    return json.loads('{{')\nTABLE = setup()\n",
            ["failed on import: JSONDecodeError: Expecting property name", "({p}, line 3); fix it there"],
        ),
        ("import sys\nsys.exit('no config here')\n", ["SystemExit: no config here ({p}, line 2)"]),
    ],
)
def test_a_plugin_that_fails_on_import_is_one_line_naming_its_file_and_line(tmp_path, capsys, source, needles):
    p = tmp_path / "plugin.py"
    p.write_text(source)
    err = toy_error(capsys, tmp_path, f"tools=[{p}:f]")
    assert all(n.format(p=p) in err for n in needles), err
    p.write_text("def f(key: str) -> str:\n    return key\n")  # fixed: the next load runs the file again
    assert M.load_object(f"{p}:f", "tool")("k") == "k"


def test_a_plugin_imports_the_modules_beside_it(tmp_path):
    task = tmp_path / "my_task"
    task.mkdir()
    (task / "my_task_calc.py").write_text("def rows():\n    return [{'prompt': 'What is 2+2?', 'answer': '4'}]\n")
    (task / "task.py").write_text("from my_task_calc import rows\n\ndef make_dataset():\n    return rows()\n")
    path = list(sys.path)
    assert M.load_rows(f"{task}/task.py:make_dataset") == [{"prompt": "What is 2+2?", "answer": "4"}]
    assert sys.path == path, "the plug-in's folder is on sys.path only while it loads"


PLUGINS = """
async def lookup(key: str) -> str:
    return key

class Tool:
    __name__ = "tool"
    async def __call__(self, key: str) -> str:
        return key

tool = Tool()
NOT_A_FUNCTION = "lookup"

async def reward(completions, **kw):
    return [1.0] * len(completions)

def stream(completions, **kw):
    yield 1.0
"""


@pytest.mark.parametrize(
    "override,needle",
    [
        (
            "tools=[tools/kv_lookup.py:lookup, {p}:lookup]",
            "tool '{p}:lookup' is an async def or a generator, not a function that returns its result; write it as a plain",
        ),
        ("tools=[{p}:tool]", "tool '{p}:tool' is an async def or a generator"),
        ("tools=[{p}:NOT_A_FUNCTION]", "tool '{p}:NOT_A_FUNCTION' is a str, not a function"),
        ("outcome_reward_funcs=[{p}:reward]", "reward function '{p}:reward' is an async def or a generator"),
        ("turn_reward_funcs=[{p}:stream]", "reward function '{p}:stream' is an async def or a generator"),
        (
            "tools=[tools/kv_lookup.py:lookup, {d}/other.py:lookup]",
            "tools '{r}/tools/kv_lookup.py:lookup' and '{d}/other.py:lookup' are both named 'lookup'; rename one",
        ),
    ],
)
def test_tools_and_rewards_that_could_only_fail_later_fail_at_load(tmp_path, capsys, override, needle):
    (tmp_path / "plugins.py").write_text(PLUGINS)
    (tmp_path / "other.py").write_text("def lookup(key: str) -> str:\n    return 'other'\n")
    fmt = dict(p=tmp_path / "plugins.py", d=tmp_path, r=os.path.dirname(os.path.abspath(M.__file__)))
    err = toy_error(capsys, tmp_path, override.format(**fmt))
    assert needle.format(**fmt) in err, err


def test_a_dataset_function_that_raises_is_one_line_naming_its_line(tmp_path, capsys):
    (tmp_path / "data.py").write_text("def rows():\n    return [{'prompt': q} for q in open('/no/such/file')]\n")
    err = toy_error(capsys, tmp_path, f"dataset={tmp_path}/data.py:rows")
    assert f"dataset function '{tmp_path}/data.py:rows' raised: FileNotFoundError:" in err, err
    assert f"({tmp_path}/data.py, line 2); fix it there" in err, err


def test_dataset_rows_must_share_their_columns(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "x"}\n{"prompt": "b"}\n')
    with pytest.raises(M.ConfigError, match=r"row 1 lacks column\(s\) answer that row 0 does not; every row needs"):
        M.load_rows(str(path))
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "answer": "x"}\n')
    with pytest.raises(M.ConfigError, match=r"row 1 has column\(s\) answer that row 0 does not"):
        M.load_rows(str(path))


@pytest.mark.parametrize(
    "data,needle",
    [
        (
            b'{"prompt": "a"}\n\n{"prompt": "b"}\n{"prompt": "c",}\n',
            "d.jsonl, line 4, column 16: not JSON (Expecting property name",
        ),
        (b'{"prompt": "a"}\n\n["b"]\n', "d.jsonl', line 3: row 1 is ['b'], not an object with a 'prompt'"),
        (
            b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n',
            "d.jsonl, line 2: byte 15 of the line is not UTF-8 (invalid continuation byte); save the file as UTF-8",
        ),
    ],
)
def test_a_jsonl_dataset_that_does_not_parse_is_one_line_naming_the_files_line(tmp_path, capsys, data, needle):
    (tmp_path / "d.jsonl").write_bytes(data)
    err = toy_error(capsys, tmp_path, f"dataset={tmp_path}/d.jsonl")
    assert needle in err, err


@pytest.mark.parametrize(
    "prompt,needle",
    [
        (5, "has prompt 5;"),
        ("  ", "has prompt '  ';"),
        ([], "has prompt [];"),
        ({"role": "user", "content": "q"}, "has prompt {'role': 'user', 'content': 'q'};"),
        ([{"role": "user", "content": "q"}, {"role": "user"}], "has prompt message 1: {'role': 'user'};"),
        ([{"role": "user", "content": None}], "has prompt message 0: {'role': 'user', 'content': None};"),
        (["q"], "has prompt message 0: 'q';"),
    ],
)
def test_every_prompt_is_a_string_or_a_list_of_messages_checked_at_load(tmp_path, capsys, prompt, needle):
    rows = [{"prompt": "fine"}, {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows + [{"prompt": prompt}]) + "\n")
    err = toy_error(capsys, tmp_path, f"eval_dataset={tmp_path}/d.jsonl")
    assert f"dataset '{tmp_path}/d.jsonl', line 3: row 2 {needle} a prompt must be a non-empty string" in err, err
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows + [{"answer": 1}]) + "\n")
    err = toy_error(capsys, tmp_path, f"dataset={tmp_path}/d.jsonl")
    assert "line 3: row 2 is {'answer': 1}, not an object with a 'prompt' column" in err, err
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert M.load_rows(str(tmp_path / "d.jsonl")) == rows


def test_a_model_that_cannot_be_loaded_is_one_line_saying_what_was_tried(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network: only the local cache
    for path in ("./models/none-here", f"{tmp_path}/no/such/model"):
        err = toy_error(capsys, tmp_path, f"model_name_or_path={path}")
        assert f"model_name_or_path '{path}' does not exist (no such folder); set it to a model folder" in err, err
    err = toy_error(capsys, tmp_path, "model_name_or_path=mt-grpo-tests/no-such-model")
    assert "AutoTokenizer cannot load 'mt-grpo-tests/no-such-model' as a hub id (no such folder): We couldn" in err
    (tmp_path / "empty").mkdir()
    err = toy_error(capsys, tmp_path, f"model_name_or_path={tmp_path}/empty")
    assert f"cannot load '{tmp_path}/empty' from that folder:" in err and "saved by save_pretrained" in err, err


def test_the_recipe_key_table_is_current_and_the_readme_shows_the_ci_command():
    sys.path.insert(0, "docs")
    import recipe_keys

    assert open("docs/recipe-keys.md").read() == recipe_keys.table(), (
        "docs/recipe-keys.md is stale: .venv/bin/python docs/recipe_keys.py > docs/recipe-keys.md"
    )
    assert all(f"| `{f.name}` |" in recipe_keys.table() for f in dataclasses.fields(M.Config))
    readme = open("README.md").read()
    assert "bash run.sh test" in readme and "bash run.sh test" in open(".ci/run").read()
    assert len(readme.splitlines()) <= 300, "README.md stays short; details go to docs/"


def test_the_default_runs_first_line_says_what_the_readme_measured():
    """`bash run.sh` opens with the figures README's table gives for it (median [range] over seeds), so a first-time
    user's console and the README say the same; the run's own step 1 and last-10 figures print at its end."""
    row = next(line for line in open("README.md") if line.startswith("| in-process (`bash run.sh`)"))
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    script = open("run.sh").read()
    start = script.index("training the embedded default")
    said = script[start : script.index('exec "$PY" "$TRAINER" "$DEFAULT_RECIPE"', start)]  # the echo before the run
    assert f"step 1 {cells[1]}" in said and f"steps 91-100 {cells[3]}" in said, (
        f"run.sh's first line for `bash run.sh` must quote README's in-process row: {cells[1]!r}, {cells[3]!r}"
    )


def test_every_relative_link_in_the_docs_resolves():
    import re

    for doc in ["README.md"] + sorted(glob.glob("docs/*.md")):
        text, here = open(doc).read(), os.path.dirname(doc)
        for target in re.findall(r"\]\(([^)#\s]*)(#[^)\s]*)?\)", text):
            path, anchor = target
            if path.startswith(("http://", "https://")):
                continue
            full = os.path.normpath(os.path.join(here, path)) if path else doc
            assert os.path.exists(full), f"{doc}: link to {path} does not resolve"
            if anchor and full.endswith(".md"):
                slugs = {
                    re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                    for h in re.findall(r"^#+ (.*)$", open(full).read(), re.M)
                }
                assert anchor[1:] in slugs, f"{doc}: no heading for {path}{anchor}"


def test_an_override_gives_the_run_a_folder_of_its_own_and_a_resume_finds_it():
    recipe = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
    assert M.load_config(recipe).output_dir == "runs/toy-kv--mt-grpo"
    ablation = M.load_config(recipe, ["advantage_mode=grpo_outcome", "seed=3"]).output_dir
    assert ablation == "runs/toy-kv--mt-grpo--advantage_mode=grpo_outcome--seed=3"
    resumed = M.load_config(recipe, ["advantage_mode=grpo_outcome", "seed=3", "resume_from_checkpoint=auto"])
    assert (
        resumed.output_dir == ablation and M.load_config(recipe, ["max_steps=5"]).output_dir == "runs/toy-kv--mt-grpo"
    )
    assert M.load_config(recipe, ["seed=3", "output_dir=runs/mine"]).output_dir == "runs/mine"


def test_recipe_paths_resolve_beside_the_recipe_then_the_working_folder_then_the_trainer(tmp_path, monkeypatch):
    """A recipe in a folder of its own, run from a third folder: its plug-ins beside it win, the shipped ones come
    from the trainer's folder (said), and the model is built beside its builder, wherever the run starts."""
    task = tmp_path / "mytask"
    task.mkdir()
    (task / "tools.py").write_text("def lookup(key: str) -> str:\n    return key\n")
    (task / "build.py").write_text("def build(path, system_prompt=''):\n    pass\n")
    (task / "r.yaml").write_text(
        "model_name_or_path: models/mine\nmodel_builder: build.py:build\ntools: [tools.py:lookup]\n"
        "dataset: tasks/toy_kv.py:make_dataset\noutcome_reward_funcs: [rewards/toy_kv_reward.py:exact_answer_reward]\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    said = []
    cfg = M.load_config(str(task / "r.yaml"), [], said.append)
    root = os.path.dirname(os.path.abspath(M.__file__))
    assert cfg.tools == [f"{task}/tools.py:lookup"] and cfg.model_builder == f"{task}/build.py:build"
    assert cfg.model_name_or_path == f"{task}/models/mine", "built beside its builder"
    assert cfg.dataset == f"{root}/tasks/toy_kv.py:make_dataset"
    assert cfg.outcome_reward_funcs == [f"{root}/rewards/toy_kv_reward.py:exact_answer_reward"]
    assert said == [f"[mt-grpo] rewards/toy_kv_reward.py, tasks/toy_kv.py: not beside the recipe, taken from {root}"]
    shipped = M.load_config("hf_recipes/toy/toy-kv--mt-grpo.yaml", [])  # a shipped recipe, from another folder
    assert shipped.model_name_or_path == f"{root}/.cache/toy-kv-model-hd32"
    assert shipped.model_builder == f"{root}/tasks/toy_kv.py:build_model"

"""Config: recipe keys map 1:1 to the dataclass, bad keys and types fail clearly, overrides work."""
import dataclasses
import glob
import os
import subprocess
import sys

import pytest

import mt_grpo_trainer as M
from conftest import main_error, toy_error


def write(tmp_path, text):
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return str(p)


def test_unknown_key_names_the_key_and_the_closest_valid_one(tmp_path):
    with pytest.raises(M.ConfigError, match=r"unknown config key 'learning_rte' in .*r\.yaml; did you mean 'learning_rate'"):
        M.load_config(write(tmp_path, "learning_rte: 1.0e-5\n"))
    with pytest.raises(M.ConfigError, match=r"unknown config key 'num_generation'; did you mean 'num_generations'"):
        M.load_config(None, ["num_generation=4"])


@pytest.mark.parametrize("text,err", [
    ("max_steps: ten\n", "'max_steps' must be int, got str"),
    ("max_steps: 2.5\n", "'max_steps' must be int, got float"),
    ("scale_rewards: 1\n", "'scale_rewards' must be bool"),
    ("tools: tools/kv_lookup.py:lookup\n", "'tools' must be a list"),
    ("turn_reward_weights: [1, x]\n", r"'turn_reward_weights\[1\]' must be float"),
    ("advantage_mode: ppo\n", "'advantage_mode' must be one of mt_grpo, grpo_outcome, grpo_merged"),
    ("outcome_reward_weights: [1.0, 2.0]\n", "'outcome_reward_weights' has 2 entries but 'outcome_reward_funcs' has 1"),
    ("num_generations: 1\n", "num_generations must be >= 2"),
    ("- a\n- b\n", "must be a YAML mapping"),
])
def test_wrong_types_and_values_fail(tmp_path, text, err):
    with pytest.raises(M.ConfigError, match=err):
        M.load_config(write(tmp_path, text))


def test_overrides_and_float_strings(tmp_path):
    cfg = M.load_config(write(tmp_path, "learning_rate: 1e-5\nmax_steps: 3\n"),
                        ["max_steps=7", "beta=0.04", "tools=[a.py:f, b.py:g]", "report_to=wandb", "output_dir=/tmp/x"])
    assert cfg.learning_rate == 1e-5            # YAML reads 1e-5 as a string; a float field accepts it
    assert cfg.max_steps == 7 and cfg.beta == 0.04 and cfg.tools == ["a.py:f", "b.py:g"] and cfg.report_to == "wandb"
    assert M.load_config(write(tmp_path, "seed: 1\n")).output_dir == "runs/r"   # default: runs/<recipe name>
    with pytest.raises(M.ConfigError, match="must look like key=value"):
        M.load_config(None, ["max_steps"])


def test_yaml_off_and_no_stay_strings_and_string_overrides_stay_verbatim(tmp_path):
    cfg = M.load_config(write(tmp_path, "tokenization_check: off\nmixed_precision: no\nscale_rewards: false\n"),
                        ["system_prompt=Answer: briefly", "wandb_project=2025"])
    assert (cfg.tokenization_check, cfg.mixed_precision, cfg.scale_rewards) == ("off", "no", False)
    assert cfg.system_prompt == "Answer: briefly" and cfg.wandb_project == "2025"


def test_every_field_has_a_default_and_a_docstring():
    docs = M.field_docs()
    for f in dataclasses.fields(M.Config):
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
        assert docs.get(f.name, "").strip(), f"Config.{f.name} has no docstring"


@pytest.mark.parametrize("recipe", sorted(glob.glob("hf_recipes/**/*.yaml", recursive=True)))
def test_every_shipped_recipe_loads_and_its_plugins_resolve(recipe):
    cfg = M.load_config(recipe)
    for spec in cfg.tools + cfg.turn_reward_funcs + cfg.outcome_reward_funcs:
        assert callable(M.load_object(spec))


def test_missing_plugin_file_and_function_are_named():
    with pytest.raises(M.ConfigError, match="reward file not found: 'rewards/nope.py'"):
        M.load_object("rewards/nope.py:f", "reward")
    with pytest.raises(M.ConfigError, match="reward 'nope' not found in rewards/toy_kv_reward.py"):
        M.load_object("rewards/toy_kv_reward.py:nope", "reward")


@pytest.mark.parametrize("recipe,override,needles", [
    (b"max_steps: 3\nsystem_prompt: Answer: briefly\n", None,
     ["r.yaml, line 2, column 22: not valid YAML: mapping values are not allowed here", "quote values"]),
    (b"tools: [tools/kv_lookup.py:lookup\nseed: 1\n", None, ["r.yaml, line 2, column 5:", "from line 1, column 8"]),
    (b"seed: 1\nsystem_prompt: caf\xe9\n", None,
     ["r.yaml, position 26: not valid YAML: invalid continuation byte", "save it as UTF-8"]),
    (b"seed: 1\n", "tools=[tools/kv_lookup.py:lookup",
     ["the value of override 'tools=[tools/kv_lookup.py:lookup', line 1, column 27: not valid YAML"]),
])
def test_a_recipe_or_override_that_is_not_valid_yaml_is_one_line_naming_the_line(tmp_path, capsys, recipe, override,
                                                                                   needles):
    (tmp_path / "r.yaml").write_bytes(recipe)
    err = main_error(capsys, str(tmp_path / "r.yaml"), *[override] * bool(override))
    assert all(n in err for n in needles), err


@pytest.mark.parametrize("source,needles", [
    ("X = 1\ndef f(:\n    pass\n",
     ["tool file '{p}' failed on import: SyntaxError: invalid syntax (plugin.py, line 2); fix it"]),
    ("import json\nimport no_such_module_for_mt_grpo\n",
     ["ModuleNotFoundError: No module named 'no_such_module_for_mt_grpo' ({p}, line 2); install the missing package"]),
    ("import json\ndef setup():\n    return json.loads('{{')\nTABLE = setup()\n",
     ["failed on import: JSONDecodeError: Expecting property name", "({p}, line 3); fix it there"]),
    ("import sys\nsys.exit('no config here')\n", ["SystemExit: no config here ({p}, line 2)"]),
])
def test_a_plugin_that_fails_on_import_is_one_line_naming_its_file_and_line(tmp_path, capsys, source, needles):
    p = tmp_path / "plugin.py"
    p.write_text(source)
    err = toy_error(capsys, tmp_path, f"tools=[{p}:f]")
    assert all(n.format(p=p) in err for n in needles), err
    p.write_text("def f(key: str) -> str:\n    return key\n")     # fixed: the next load runs the file again
    assert M.load_object(f"{p}:f", "tool")("k") == "k"


def test_a_dataset_function_that_raises_is_one_line_naming_its_line(tmp_path, capsys):
    (tmp_path / "data.py").write_text("def rows():\n    return [{'prompt': q} for q in open('/no/such/file')]\n")
    err = toy_error(capsys, tmp_path, f"dataset={tmp_path}/data.py:rows")
    assert f"dataset function '{tmp_path}/data.py:rows' raised: FileNotFoundError:" in err, err
    assert f"({tmp_path}/data.py, line 2); fix it there" in err, err


def test_cli_reports_config_errors_without_a_traceback():
    r = subprocess.run([sys.executable, "mt_grpo_trainer.py", "hf_recipes/toy/toy-kv--mt-grpo.yaml", "bogus_key=1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "unknown config key 'bogus_key'" in r.stderr and "Traceback" not in r.stderr
    h = subprocess.run([sys.executable, "mt_grpo_trainer.py", "--help"], capture_output=True, text=True, timeout=120)
    assert h.returncode == 0 and "turn_advantage_coef" in h.stdout and "lambda: weight of the turn advantage" in h.stdout


def test_the_recipe_key_table_is_current_and_the_readme_shows_the_ci_command():
    sys.path.insert(0, "docs")
    import recipe_keys
    assert open("docs/recipe-keys.md").read() == recipe_keys.table(), \
        "docs/recipe-keys.md is stale: .venv/bin/python docs/recipe_keys.py > docs/recipe-keys.md"
    assert all(f"| `{f.name}` |" in recipe_keys.table() for f in dataclasses.fields(M.Config))
    readme = open("README.md").read()
    assert "bash run.sh test" in readme and "bash run.sh test" in open(".ci/run").read()
    assert len(readme.splitlines()) <= 300, "README.md stays short; details go to docs/"


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
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                         for h in re.findall(r"^#+ (.*)$", open(full).read(), re.M)}
                assert anchor[1:] in slugs, f"{doc}: no heading for {path}{anchor}"

"""A model built by model_builder keeps what built it (build_report.json's built_by: the builder, its sources' hashes
and the system prompt it was given); a run whose builder changed since stops in one line that says how to rebuild."""

import hashlib
import json
import shutil

from conftest import main_error, recipe_cfg
import mt_grpo_trainer as M

BUILDER = """import json, os
from helpers import WIDTH  # a sibling: part of what builds the model

def build(path, system_prompt):
    with open(os.path.join(os.path.dirname(path), "builds"), "a") as f:
        f.write("1")
    json.dump({"builder": "builder.py", "params": WIDTH}, open(os.path.join(path, "build_report.json"), "w"))
"""


def task(tmp_path):
    (tmp_path / "builder.py").write_text(BUILDER)
    (tmp_path / "helpers.py").write_text("WIDTH = 64\n")
    return [f"model_name_or_path={tmp_path}/model", f"model_builder={tmp_path}/builder.py:build"]


def test_the_report_records_the_builder_its_sources_and_its_system_prompt(tmp_path):
    cfg = recipe_cfg(tmp_path, *task(tmp_path), "system_prompt=Tools: {tools}")
    M.build_model_if_missing(cfg, print)
    report = json.loads((tmp_path / "model" / "build_report.json").read_text())
    assert report["params"] == 64, "the builder's own report is kept"
    built_by = report["built_by"]
    assert built_by["model_builder"] == "builder.py:build" and built_by["system_prompt"].startswith("Tools: ")
    assert sorted(built_by["sources"]) == ["builder.py", "helpers.py"], "its sibling import is one of its sources"
    assert not any(name.endswith("json/__init__.py") for name in built_by["sources"]), "not the standard library"


def test_a_model_whose_builder_changed_stops_the_run_in_one_line_until_it_is_rebuilt(tmp_path, capsys):
    overrides = [*task(tmp_path), f"output_dir={tmp_path}/run"]
    M.build_model_if_missing(recipe_cfg(tmp_path, *overrides), print)
    M.build_model_if_missing(recipe_cfg(tmp_path, *overrides), print)  # the same builder: used as it is
    assert (tmp_path / "builds").read_text() == "1"
    recipe = "hf_recipes/toy/toy-kv--mt-grpo.yaml"
    changes = [
        ("helpers.py", "WIDTH = 128\n", "helpers.py"),
        ("builder.py", BUILDER.replace("params", "size"), "builder.py"),
    ]
    for name, text, named in changes:
        before = (tmp_path / name).read_text()
        (tmp_path / name).write_text(text)
        err = main_error(capsys, recipe, *overrides)
        assert f"{tmp_path}/model was built by another model_builder than" in err
        assert f"(changed since: {named}): delete the folder to rebuild it (rm -r {tmp_path}/model)" in err, err
        (tmp_path / name).write_text(before)
    err = main_error(capsys, recipe, *overrides, "system_prompt=Use the tools.")
    assert "(changed since: system_prompt)" in err
    assert (tmp_path / "builds").read_text() == "1", "never rebuilt behind the user's back"
    M.build_model_if_missing(recipe_cfg(tmp_path, *overrides), print)  # its sources as they were: used again
    shutil.rmtree(tmp_path / "model")
    (tmp_path / "helpers.py").write_text("WIDTH = 128\n")
    M.build_model_if_missing(recipe_cfg(tmp_path, *overrides), print)  # deleted: built again, as the line says
    assert (tmp_path / "builds").read_text() == "11"
    sources = json.loads((tmp_path / "model" / "build_report.json").read_text())["built_by"]["sources"]
    assert sources["helpers.py"] == hashlib.sha256(b"WIDTH = 128\n").hexdigest()


def test_a_model_folder_without_a_record_is_said_and_used(tmp_path, capsys):
    """A folder built before build records (or made by hand) cannot be checked: a note says so, and the run goes on."""
    overrides = task(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "build_report.json").write_text('{"builder": "builder.py"}')
    M.build_model_if_missing(recipe_cfg(tmp_path, *overrides), print)
    out = capsys.readouterr().out
    assert f"note: {tmp_path}/model has no record of what built it" in out and "delete the folder" in out
    assert not (tmp_path / "builds").exists()

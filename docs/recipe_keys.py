"""Writes docs/recipe-keys.md from the trainer's `Config`: its fields, types, defaults and docstrings, the
same source as `python mt_grpo_trainer.py --help`. tests/test_config.py fails when the file is stale.

    .venv/bin/python docs/recipe_keys.py > docs/recipe-keys.md
"""

import dataclasses
import os
import sys
import typing

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mt_grpo_trainer as M  # noqa: E402

HEAD = """# Recipe keys

A recipe is a YAML file whose keys map 1:1 to the fields of `Config` in `mt_grpo_trainer.py`; `key=value`
arguments after the recipe override them.
- An unknown key is an error naming the closest valid key; a wrong type, a value outside its range (the
  "valid" column) or a key written twice is an error naming the key.
- Numbers written as YAML strings (`1e-6`) are accepted for float keys; only `true`/`false` are booleans,
  so `tokenization_check: off` stays the string `off`.
- The resolved config is saved as `<output_dir>/config.yaml`, which loads again as a recipe.

This table is generated from `Config` by [`recipe_keys.py`](recipe_keys.py), as `--help` is.

| key | type | default | valid | meaning |
|---|---|---|---|---|
"""


def table() -> str:
    docs, hints, ranges, allowed = M.field_docs(), typing.get_type_hints(M.Config), M.field_ranges(), M.choices()
    rows = []
    for f in dataclasses.fields(M.Config):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        shown = "(XML protocol prompt)" if f.name == "system_prompt" else repr(default)
        typ = getattr(hints[f.name], "__name__", str(hints[f.name]))
        typ = str(hints[f.name]) if typing.get_origin(hints[f.name]) else typ
        valid = ranges.get(f.name) or " \\| ".join(allowed.get(f.name, ()))
        rows.append(f"| `{f.name}` | {typ} | `{shown}` | {valid} | {docs[f.name].replace('|', chr(92) + '|')} |")
    return HEAD + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())

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

`Config` is a plain dataclass: each key's type, default, docstring and rule (`Annotated[float, "(0, 2]"]`, or a tuple
or registry of choices) sit on its line, and `load_config` (appendix F, about 130 lines of Python and PyYAML) checks
them. pydantic v2 was measured in its place twice and not taken. The second prototype (a pydantic dataclass with
`use_attribute_docstrings`, `extra="forbid"`, `allow_inf_nan=False`, strict types, `Field(gt=0, le=2)`, Literal and
registry validators) cut the loader by 95 code tokens, but `Config` grew by 320 (`Field(gt=0, le=2)` where it says
`"(0, 2]"`): the file gained 232 tokens and saved no line. Its messages name only the bound that failed ("Input should
be greater than 0" for `temperature=0`, not "(0, 2]"), `--help` stayed the same only through 18 lines that rebuild the
range text from its constraints, a number no longer loads into a string key, and it is one more dependency. The recipe
reader (`off`, keys written twice), the closest-key hint and the file or override each message names stay our code
either way. tyro is not a fit either: it builds a
`--key value` command line, not YAML recipes with `key=value` overrides.

This table is generated from `Config` by [`recipe_keys.py`](recipe_keys.py), as `--help` is.

| key | type | default | valid | meaning |
|---|---|---|---|---|
"""


def table() -> str:
    docs, hints, rules = M.field_docs(), typing.get_type_hints(M.Config), M.field_rules()
    rows = []
    for name, default in dataclasses.asdict(M.Config()).items():
        shown = "(XML protocol prompt)" if name == "system_prompt" else repr(default)
        typ = str(hints[name]) if typing.get_origin(hints[name]) else hints[name].__name__
        rule = rules.get(name, ())
        valid = rule if isinstance(rule, str) else " \\| ".join(rule)
        rows.append(f"| `{name}` | {typ} | `{shown}` | {valid} | {docs[name].replace('|', chr(92) + '|')} |")
    return HEAD + "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(table())

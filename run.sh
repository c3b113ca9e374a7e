#!/usr/bin/env bash
# Set-up and launch for mt-grpo.
#   bash run.sh                          set up, then train the embedded CPU default
#   bash run.sh RECIPE.yaml [key=value]  set up, then train any recipe with overrides
#   bash run.sh test [pytest args]       set up, then run the test suite (what CI runs)
# Set-up creates or reuses .venv and installs the pinned requirements.txt whenever it changes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
VENV=${MTGRPO_VENV:-.venv}
DEFAULT_RECIPE=hf_recipes/toy/toy-kv--mt-grpo.yaml

if [ ! -x "$VENV/bin/python" ]; then
  echo "[run.sh] creating $VENV with $(python3 --version)"
  python3 -m venv "$VENV"
fi
want=$(sha256sum requirements.txt | cut -d' ' -f1)
if [ "$(cat "$VENV/.requirements.sha256" 2>/dev/null)" != "$want" ]; then
  echo "[run.sh] installing pinned requirements into $VENV (torch 2.13.0 and friends; about a minute)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt
  echo "$want" > "$VENV/.requirements.sha256"
fi

case "${1:-}" in
  test) shift; exec "$VENV/bin/python" -m pytest -q tests "$@" ;;
  "")   exec "$VENV/bin/python" mt_grpo_trainer.py "$DEFAULT_RECIPE" ;;
  *)    exec "$VENV/bin/python" mt_grpo_trainer.py "$@" ;;
esac

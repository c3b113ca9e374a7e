"""The toy task's harness (tasks/toy_kv_agent.py) as a command line (agent_command): the row as JSON on stdin, the
endpoint in OPENAI_BASE_URL, which the plain `openai` client reads itself; the last reply printed. `agent(row, base_url)` is the
same harness as a function, for worker processes (agent_processes). Faults by the row's `key`: `hangs` (after starting
a process of its own), `raises`, `fails` (exit status 3, as a command) and `leaves` (a process still running when it
returns); the pids of what it starts go to the row's `pidfile`."""

import json
import os
import subprocess
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.toy_kv_agent import agent as toy_agent  # noqa: E402


def start_a_process(row: dict):
    """A process of the harness's own, in its process group; this process's pid and its pid to the row's pidfile."""
    child = subprocess.Popen(["sleep", "600"])
    with open(row["pidfile"], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")


def agent(row: dict, base_url: str | None = None):
    if row["key"] == "hangs":
        start_a_process(row)
        time.sleep(600)
    if row["key"] == "raises":
        raise ValueError("the harness's own bug")
    if row["key"] == "leaves":
        start_a_process(row)
    text = toy_agent(row, base_url)  # base_url None: the openai client reads OPENAI_BASE_URL itself
    if row.get("say_pid"):  # which process ran it; a dict travels back as JSON
        return {"answer": text, "pid": os.getpid()}
    return text


if __name__ == "__main__":
    row = json.load(sys.stdin)
    if row["key"] == "fails":
        print("the command's own failure", file=sys.stderr)
        sys.exit(3)
    print(agent(row))

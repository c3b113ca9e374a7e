"""The toy task's harness as a command line (agent_command): the row as JSON on stdin, the endpoint in OPENAI_BASE_URL
and OPENAI_API_KEY, which the plain `openai` client reads itself; the last reply printed. `agent(row, base_url)` is the
same harness as a function, for worker processes (agent_processes). Faults by the row's `key`: `hangs` (after starting
a process of its own), `raises`, `fails` (exit status 3, as a command) and `leaves` (a process still running when it
returns); the pids of what it starts go to the row's `pidfile`."""

import json
import os
import subprocess
import sys
import time

import openai

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks.toy_kv_agent import TOOL, run_tool  # noqa: E402


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
    messages = [{"role": "user", "content": row["prompt"]}]
    key = os.environ.get("OPENAI_API_KEY", "unused")  # a command's, which the client would read itself too
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0) as client:  # base_url None: OPENAI_BASE_URL
        while True:
            choice = client.chat.completions.create(model="policy", messages=messages).choices[0]
            text = choice.message.content
            messages.append({"role": "assistant", "content": text})
            call = TOOL.search(text)
            if choice.finish_reason == "length" or call is None:
                break
            messages.append({"role": "tool", "content": run_tool(call.group(1))})
    if row.get("say_pid"):  # which process ran it; a dict travels back as JSON
        return {"answer": text, "pid": os.getpid()}
    return text


if __name__ == "__main__":
    row = json.load(sys.stdin)
    if row["key"] == "fails":
        print("the command's own failure", file=sys.stderr)
        sys.exit(3)
    print(agent(row))

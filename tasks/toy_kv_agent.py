"""The embedded key-value task written as an agent harness: its own loop, its own tool, the OpenAI client.

`hf_recipes/toy/toy-kv-agent--mt-grpo.yaml` trains it (`agent: tasks/toy_kv_agent.py:agent`). For each episode the
trainer calls `agent(row, base_url)`; every request to `base_url` is one assistant turn of the policy in training.
The loop is the built-in environment's for this task (the XML protocol, a `lookup` tool, results sent back as role
`tool` messages, which the XML format shows as `<result>...</result>`), so the two learn the same task.
"""

import json
import os
import re
import sys

import openai

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.kv_lookup import lookup  # noqa: E402

TOOL = re.compile(r"<tool>(.*?)</tool>", re.S)


def run_tool(payload: str) -> str:
    """The tool call's result, or its error as the model should read it."""
    try:
        call = json.loads(payload)
        if not isinstance(call, dict) or call.get("name") != "lookup":
            raise ValueError(f"unknown tool {call.get('name') if isinstance(call, dict) else call!r}; tools: lookup")
        return lookup(**call.get("args", {}))
    except Exception as e:  # noqa: BLE001 - the model reads the error and may try again
        return f"Error: {type(e).__name__}: {e}"


# One client a process: building one loads the CA certificates (~26 ms of CPU), which an episode's call would pay again
CLIENT = openai.OpenAI(api_key="unused", max_retries=0)


def agent(row: dict, base_url: str) -> str:
    """Ask, call `lookup` while the model asks for it, return the last reply."""
    messages = [{"role": "user", "content": row["prompt"]}]
    client = CLIENT.with_options(base_url=base_url)  # this episode's URL over the process's connections
    while True:
        choice = client.chat.completions.create(model="policy", messages=messages).choices[0]
        text = choice.message.content
        messages.append({"role": "assistant", "content": text})
        call = TOOL.search(text)
        if choice.finish_reason == "length" or call is None:
            return text
        messages.append({"role": "tool", "content": run_tool(call.group(1))})

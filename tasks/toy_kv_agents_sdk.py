"""The key-value task as an OpenAI Agents SDK agent (`openai-agents`): the SDK's own loop, function tool and model,
which calls the Responses API, on its defaults.

For each episode the trainer calls `agent(row, base_url)` (docs/agents.md). The SDK is told two things, both per
episode: the client for the episode's `base_url`, and the name of the one model the endpoint serves, `policy`.
Everything else is the SDK's default. Tracing is off: an episode of a training run is not a trace to upload. The tool
is native (`tool_format: native`): the SDK sends its JSON schema, and the chat template renders it.
"""

import asyncio
import os
import sys

import httpx
import openai
from agents import Agent, RunConfig, Runner, function_tool
from agents.models.openai_provider import OpenAIProvider

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.kv_lookup import lookup as kv_lookup  # noqa: E402


@function_tool
def lookup(key: str) -> str:
    """Look up the value stored under a key.

    Args:
        key: the key to look up.
    """
    return kv_lookup(key)


AGENT = Agent(
    name="kv",
    instructions="Look the key up with the lookup tool, then answer with its value as <answer>value</answer>.",
    tools=[lookup],
)


# One TLS context a process: building one loads the CA certificates (~26 ms of CPU, even for an http:// URL). The client
# belongs to its episode's event loop, so each episode builds one, over an HTTP client that reuses this context.
TLS = httpx.create_ssl_context()


async def run(row: dict, base_url: str) -> str:
    http = openai.DefaultAsyncHttpxClient(verify=TLS)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=http) as client:
        config = RunConfig(model="policy", model_provider=OpenAIProvider(openai_client=client), tracing_disabled=True)
        result = await Runner.run(AGENT, row["prompt"], run_config=config)
    return result.final_output


def agent(row: dict, base_url: str) -> str:
    """One episode: the SDK's run, in an event loop of this thread's own; its final output."""
    return asyncio.run(run(row, base_url))

"""mt-grpo: multi-turn GRPO with turn-level credit assignment (MT-GRPO), in one file.

MT-GRPO (Zeng et al. 2025, arXiv 2505.11821) trains a tool-using agent with GRPO, but gives the
tokens written *before the first tool result* their own turn-level advantage:

    A(token) = A_outcome + lambda * A_turn    for tokens before the first tool result
    A(token) = A_outcome                      after it                      (paper Eq. 5)

so the query that found the answer is credited for finding it, not only for the final answer.
In general every assistant turn k of an episode gets its own advantage, and its tokens take it:

    A_k = Q_k - b(s_k),   Q_k = r_k + r_k+1 + ... + R_outcome   (the reward-to-go of turn k)

where the baseline b may depend only on the state s_k the turn was sampled in, never on what the turn or its own
trajectory did later (how many turns it took, above all). Branching rollouts make such baselines: an episode goes on
b ways from the same tokens after a tool result, and the siblings' mean Q is b(s_k) (advantage_mode tree, any number
of turns). Eq. 5 is the case of two segments split at the first tool result, each with its group as baseline.
One training step, as `train()` runs it: rollout -> reward -> advantage -> update -> sync -> log -> save.

The invariants (each has tests; comments below cite them as I1-I6):
  I1 token faithfulness. Every token with loss_mask 1 is a token the sampler sampled, at the position where it
     was sampled, after exactly the context the sampler saw. Sampled text is never decoded and re-encoded for training.
  I2 alignment. In every sample, input_ids, loss_mask, sampler logprobs, turn index and advantages have the same length.
  I3 masking. Prompt, chat-template, tool-result and padding tokens have loss_mask 0, and so do the tokens a branch
     shares with the path it branched from (that path trains them: each sampled token is trained once).
  I4 extension. A sample grows only while each new prompt starts with everything the sample holds (or, a
     counted REALIGN, all but a last turn's tail of whitespace or end markers, which becomes context). When it
     does not (the template rewrote history, or thinking was compacted), the sample closes and a new one starts
     from exactly what the sampler sees next: a counted fork. Merged turns cost O(T).
  I5 template faithfulness. What the sampler sees is the chat template's rendering of the conversation
     under `thinking_retention`; a tokenization check against a fresh full rendering reports any drift.
  I6 no silent junk. A failed request, a bad tool call, a tool error or timeout, or a truncated turn
     never becomes invented training tokens. Each is a counted outcome: an error result the model
     sees, a masked or dropped sample, a retried request, or an error that stops the run.

Reading order: config, data types, the method as pure functions (rewards, advantages, loss), tool formats,
the environment, the train step and loop, the CLI; then an appendix of plumbing the method does not depend on.
The four things changed most, each in one place:
- credit: an advantage mode, a function from one group to one advantage per assistant turn (ADVANTAGE_MODES);
- a tool format: one class that owns what its calls and results look like (TOOL_FORMATS);
- a sampler: one class behind the interface written at the top of appendix C, and the line in `setup` that picks it;
- a task: a dataset, tools, reward functions and a recipe, loaded by path (`file.py:name`; see Config), or an agent
  harness of your own, whose requests to an endpoint per episode are the environment's turns (appendix H).

Run: `bash run.sh [eval] [RECIPE.yaml [key=value ...]]` (sets up, and starts a vLLM server where the layout has one),
or `python mt_grpo_trainer.py [eval] RECIPE.yaml [key=value ...]`; `--help` documents every recipe key.

Left out on purpose (and why):
- value networks and GAE: GRPO's group baseline is the point of the method;
- padding where packing is checked exact: training packs samples into rows, each a prefix trie (a group's prompt and
  a branch's context are computed once; `pack_rows`), and gathers each sample's logprobs back, so the loss still
  reads one row per sample; a family not checked exact packed trains in padded rows, one sample a row (`layout`);
- Ray: one process per GPU. By default rollout and update take turns, so `breakpoint()` works and the policy is
  exactly on-policy; max_staleness >= 1 overlaps them with one producer thread per rank (see RolloutProducer);
- `model.generate` in the local sampler: its logits processors run before the temperature and top-p warpers, so
  its sampling logprobs cost every step's full-vocabulary scores; a 30-line KV-cache decode loop is exact and bounded.
"""

from __future__ import annotations

import ast
import collections
import concurrent.futures
import contextlib
import copy
import dataclasses
import datetime
import difflib
import functools
import glob
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import inspect
import itertools
import json
import math
import numbers
import os
import queue
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import typing
import unicodedata
from dataclasses import dataclass, field
from typing import Annotated

import filelock
import numpy as np
import requests
import torch
import torch.distributed as dist
import yaml
from tqdm import tqdm

# === 1. Config ===========================================================================


@dataclass
class Config:
    """Every recipe key: its type, default and docstring, which `--help` and docs/recipe-keys.md show. Beside a type,
    `Annotated[type, rule]` says what the loader (appendix F) accepts: a range ('(0, 2]', '>= 1', 'finite'; every
    number must be finite), or the choices (a tuple, or a registry whose keys they are: one registered counts too).
    The registries are defined with what they register, further down: ADVANTAGE_MODES and LOSS_AGGREGATIONS in section
    3 (the method), TOOL_FORMATS in section 4 (tool formats)."""

    # --- model and data
    model_name_or_path: str = ".cache/toy-kv-model-hd32"
    """HF hub id or local folder holding the policy model and its tokenizer."""
    model_builder: str = ""
    """`file.py:function` that creates `model_name_or_path` when that folder does not exist yet; build_report.json
    records what built it, and a run whose builder or its sources changed since stops (delete the folder to rebuild)."""
    dataset: str = "tasks/toy_kv.py:make_dataset"
    """Prompts: a .jsonl file, or `file.py:function` returning a list of dicts; each row needs `prompt`."""
    system_prompt: str = (
        'Think inside <reasoning>...</reasoning>. Then either call a tool as <tool>{"name": NAME, '
        '"args": {...}}</tool> or give the final answer as <answer>...</answer>.\nTools:\n{tools}'
    )
    """System prompt; `{tools}` is replaced by one line per tool (name, signature, docstring)."""
    tools: list[str] = field(default_factory=lambda: ["tools/kv_lookup.py:lookup"])
    """Tool functions as `file.py:function`; the model calls each by its function name."""
    agent: str = ""
    """An agent harness `file.py:fn` instead of `tools`: `fn(row, base_url)` runs its own loop against an
    OpenAI-compatible endpoint per episode, each request one turn (docs/agents.md)."""
    agent_processes: Annotated[int, ">= 0"] = 0
    """With `agent`: 0 runs each episode's harness in a thread of the trainer; N runs them in N worker processes (the
    episodes of one in threads of it), so the harness's Python does not take the trainer's interpreter lock."""
    agent_command: str = ""
    """An agent harness as a command line instead of `agent` (an agent CLI, a harness in any language): a process per
    episode, the row as JSON on its stdin, its base_url as OPENAI_BASE_URL; what it prints is agent_result."""
    agent_timeout: Annotated[float, "> 0"] = 600.0
    """Seconds a rollout waits for its harnesses; one still running then ends its episode `agent_timeout`."""
    turn_reward_funcs: list[str] = field(default_factory=lambda: ["rewards/toy_kv_reward.py:lookup_hit_reward"])
    """Turn-level reward functions (`file.py:function`). Per episode, a number (it scores the turns before the first
    tool result, and sits on the turn that called it) or a list with one number per assistant turn."""
    turn_reward_weights: Annotated[list[float], "finite"] = field(default_factory=list)
    """Weights of `turn_reward_funcs` (empty = all 1.0)."""
    outcome_reward_funcs: list[str] = field(default_factory=lambda: ["rewards/toy_kv_reward.py:exact_answer_reward"])
    """Outcome-level reward functions (`file.py:function`), scored on the whole episode."""
    outcome_reward_weights: Annotated[list[float], "finite"] = field(default_factory=list)
    """Weights of `outcome_reward_funcs` (empty = all 1.0)."""
    reward_timeout: Annotated[float, "> 0"] = 300.0
    """Seconds one reward function call may run; past it the run stops with an error naming the function."""
    tool_format: Annotated[str, TOOL_FORMATS] = "xml"
    """A key of TOOL_FORMATS: xml (the paper's <tool>/<result> protocol) | native (the chat template's tool calling:
    JSON schemas, <tool_call>, role 'tool')."""
    thinking_retention: Annotated[str, ("template", "tool_cycle", "all")] = "template"
    """template (the chat template decides) | tool_cycle (also keep thinking in the in-flight tool cycle) | all (keep
    every past thinking block)."""
    thinking_compaction_turns: Annotated[int, ">= 0"] = 0
    """With tool_cycle or all: every N turns, strip thinking older than the last N turns (extension breaks once per
    N; 0 = never)."""
    chat_template_kwargs: dict = field(default_factory=dict)
    """Extra variables for the chat template, e.g. {enable_thinking: false} for Qwen3 without thinking."""
    tool_timeout: Annotated[float, "> 0"] = 30.0
    """Seconds a tool call may run; past it the model gets an error result and the episode goes on."""
    tool_output_max_chars: Annotated[int, ">= 1"] = 8000
    """A tool result longer than this is cut (with a note saying so) before it is tokenized."""
    realign_max_tokens: Annotated[int, ">= 0"] = 16
    """REALIGN: a fresh rendering that departs from the held text only in the last turn's sampled tail, past which at
    most this many sampled tokens hold nothing but whitespace or special tokens, turns them into context (mask 0)
    in the same sample instead of forking (0 = always fork)."""
    tokenization_check: Annotated[str, ("strict", "ignore_strippable", "off")] = "ignore_strippable"
    """strict | ignore_strippable | off: compare each sample with a fresh rendering; a mismatch stops the run
    (whitespace-only ones pass under ignore_strippable)."""
    # --- rollout
    prompts_per_step: Annotated[int, ">= 1"] = 8
    """Distinct prompts per step (P); each is rolled out `num_generations` times."""
    num_generations: Annotated[int, ">= 2"] = 8
    """Episodes per prompt (G): the group that GRPO normalises rewards within; with branching, the leaves of its
    tree."""
    branch_width: Annotated[int, "[1, 16]"] = 1
    """Branching rollouts (advantage_mode tree): at each of an episode's first `branch_depth` tool results it goes on
    b ways from the same tokens, so G = roots x b^depth (1 = G independent episodes)."""
    branch_depth: Annotated[int, "[1, 8]"] = 1
    """With branch_width > 1: how many tool results (the first ones of each path) branch."""
    max_env_steps: Annotated[int, ">= 0"] = 2
    """Most tool calls per episode; a turn whose calls would pass it ends the episode, none of them run."""
    max_tokens: Annotated[int, ">= 1"] = 64
    """Most new tokens the model may sample in one assistant turn."""
    max_seq_len: Annotated[int, ">= 2"] = 512
    """Context budget: prompt plus sampled tokens of one sample never exceed it."""
    temperature: Annotated[float, "(0, 2]"] = 1.0
    """Sampling temperature; the trainer scores tokens at the same temperature."""
    top_p: Annotated[float, "(0, 1]"] = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    filter_zero_spread_groups: bool = False
    """DAPO's dynamic sampling: drop groups whose episodes all get zero advantage and roll out more prompts instead."""
    max_filter_draws: Annotated[int, ">= 0"] = 2
    """With filter_zero_spread_groups: most extra rounds of prompts per step; after them zero-spread groups fill the
    step."""
    max_staleness: Annotated[int, "[0, 8]"] = 0
    """0 = strictly on-policy. k >= 1 (vLLM server only): a producer thread rolls out up to k steps ahead while the
    trainer updates, so a trained token is at most k weight versions old."""
    # --- advantages
    advantage_mode: Annotated[str, ADVANTAGE_MODES] = "mt_grpo"
    """A key of ADVANTAGE_MODES: mt_grpo (turn/outcome split, paper Eq. 5) | mt_grpo_merged_fallback (the paper's
    code: GRPO-MR on episodes without a tool result) | grpo_outcome (GRPO-OR) | grpo_merged (GRPO-MR) |
    reward_to_go (per-turn rewards, prompt baseline) | tree (branching: sibling baselines, any number of turns) |
    state_matched (per-turn rewards, the baseline of the episodes of the group in exactly the turn's state)."""
    turn_advantage_coef: Annotated[float, ">= 0"] = 1.0
    """lambda: weight of the turn advantage on tokens before the first tool result."""
    scale_rewards: bool = True
    """The paper's modes (mt_grpo, grpo_*): divide group-centred rewards by the group std (False = centre only, as in
    Dr. GRPO)."""
    scale_returns: bool = False
    """The per-turn modes (reward_to_go, tree, state_matched): divide a group's advantages by the std of its returns
    (False = centre only: unbiased; docs/turn-credit.md measures what the division costs)."""
    # --- loss
    epsilon: Annotated[float, "[0, 1]"] = 0.2
    """PPO clip range below 1: ratios under 1 - epsilon are clipped."""
    epsilon_high: Annotated[float, ">= 0"] = 0.2
    """PPO clip range above 1: ratios over 1 + epsilon_high are clipped (DAPO's clip-higher)."""
    beta: Annotated[float, ">= 0"] = 0.0
    """KL coefficient to a frozen copy of the initial model (0 = no reference model is loaded)."""
    loss_aggregation: Annotated[str, LOSS_AGGREGATIONS] = "token_mean"
    """A key of LOSS_AGGREGATIONS: token_mean (mean over every trained token in the batch) | sequence_mean (mean over
    episodes of each episode's mean token loss: an episode weighs the same however many samples it forked into)."""
    mask_truncated_completions: bool = False
    """Leave episodes cut by max_tokens or the context budget out of the loss (their advantages still count in their
    group; with branching, only the node the cut path ended in)."""
    num_iterations: Annotated[int, ">= 1"] = 1
    """Optimizer updates per rollout batch; above 1, old logprobs are recomputed before the first."""
    is_ratio_cap: Annotated[float, ">= 0"] = 2.0
    """Cap of the trainer/sampler importance weight exp(old - sampler) per token (0 = no correction)."""
    # --- optimisation
    learning_rate: Annotated[float, "> 0"] = 1e-6
    """Peak AdamW learning rate."""
    weight_decay: Annotated[float, ">= 0"] = 0.0
    """AdamW weight decay."""
    adam_betas: Annotated[list[float], "[0, 1)"] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    max_grad_norm: Annotated[float, ">= 0"] = 1.0
    """Gradient clipping norm (0 = off)."""
    lr_scheduler: Annotated[str, ("constant", "linear", "cosine")] = "constant"
    """constant | linear | cosine, after warmup."""
    warmup_steps: Annotated[int, ">= 0"] = 0
    """Optimizer updates of linear learning-rate warmup."""
    max_steps: Annotated[int, ">= 1"] = 100
    """Training steps (one rollout batch each)."""
    micro_batch_size: Annotated[int, ">= 1"] = 16
    """Without a token budget, a micro-batch holds this many times the longest sample's tokens; gradients accumulate
    over the batch."""
    max_tokens_per_microbatch: Annotated[int, ">= 0"] = 0
    """Token budget of a forward/backward pass: packed rows (samples back to back, shared prefixes once) x the
    longest row (0 = `micro_batch_size` x the longest sample)."""
    mixed_precision: Annotated[str, ("auto", "bf16", "no")] = "auto"
    """auto (bf16 autocast where the device supports it) | bf16 | no."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    lora_rank: Annotated[int, "[0, 512]"] = 0
    """LoRA (peft) adapter rank; 0 = full fine-tuning. Only the adapters train, and only they are synced to vLLM and
    saved."""
    lora_alpha: Annotated[float, "> 0"] = 16.0
    """LoRA scale: an adapter's update is multiplied by lora_alpha / lora_rank."""
    lora_dropout: Annotated[float, "[0, 1)"] = 0.0
    """Dropout on the adapters' input in training (0: the trainer scores the distribution the sampler sampled)."""
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters, by name (q_proj, v_proj, ...), or all-linear: every linear layer but the output
    head."""
    seed: Annotated[int, ">= 0"] = 0
    """Seed for data order, sampling and initialisation."""
    # --- evaluation
    eval_dataset: str = ""
    """Held-out prompts for evaluation, as `dataset` ('' = no evaluation)."""
    eval_steps: Annotated[int, ">= 0"] = 0
    """Evaluate every N training steps (0 = only with the `eval` command)."""
    eval_max_examples: Annotated[int, ">= 0"] = 0
    """Evaluate on the first N rows of `eval_dataset` (0 = all)."""
    eval_temperature: Annotated[float, "[0, 2]"] = 0.0
    """Sampling temperature of evaluation (0 = greedy). Above 0 the in-process sampler is seeded by `seed` and the
    step, so a rerun evaluates the same episodes, and one greedy episode a row is logged beside
    (eval/greedy_NAME)."""
    eval_samples: Annotated[int, ">= 1"] = 1
    """Episodes per eval row at `eval_temperature` (a greedy eval's are all the same)."""
    # --- scale: the vLLM server and several GPUs
    vllm_server_url: list[str] = field(default_factory=list)
    """Sample from running `vllm serve` servers at these URLs, e.g. [http://10.0.0.7:8000, http://10.0.0.8:8000] (one
    may be written alone, several also comma-separated; [] = the in-process sampler)."""
    max_concurrent_requests: Annotated[int, ">= 1"] = 256
    """Most completion requests one rank keeps in flight to its servers, all together."""
    request_timeout: Annotated[float, "> 0"] = 600.0
    """Seconds one HTTP attempt may take before it is retried."""
    request_deadline: Annotated[float, "> 0"] = 1800.0
    """Seconds a request may take with all its retries (exponential backoff) before the run stops with an error."""
    weight_sync: Annotated[str, ("filesystem", "nccl")] = "filesystem"
    """filesystem (safetensors + reload_weights) | nccl (vLLM's native weight-transfer endpoints; needs vllm on the
    trainer)."""
    weight_sync_dir: str = "/dev/shm/mt-grpo"
    """Where rank 0 writes the weights the server reloads (shared memory by default; must be visible to the server)."""
    sync_every: Annotated[int, ">= 1"] = 1
    """Sync weights to the server every N training steps (1 = always on-policy)."""
    sync_check: bool = True
    """Check every weight sync with a probe scored by each server (prompt_logprobs); false for a server that cannot."""
    sync_check_max_diff: Annotated[float, ">= 0"] = 0.1
    """After each weight sync, the largest mean |server - trainer| logprob on a fixed probe sequence before the run
    stops (0 = no bound; the check that the server's logprobs moved as the trainer's did still runs)."""
    server_dead_timeout: Annotated[float, "> 0"] = 60.0
    """Seconds requests wait for a usable server once every server failed GET /health, before the run stops (a server
    that fails it is left at once while another is up)."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state with FSDP2 instead of replicating them with DDP."""
    distributed_timeout: Annotated[float, "> 0"] = 1800.0
    """Seconds a collective may wait for the other ranks before the run fails (a dead rank never hangs the rest)."""
    # --- launch: run.sh reads these to place the server and the ranks on GPUs; the trainer never does
    vllm_gpus: str = "7"
    """run.sh: CUDA devices for `vllm serve`: one server per vllm_tensor_parallel_size of them (data parallel)."""
    vllm_tensor_parallel_size: Annotated[int, ">= 1"] = 1
    """run.sh: GPUs each vLLM server spans (`--tensor-parallel-size`); vllm_gpus must hold a multiple of it."""
    train_gpus: str = "0,1,2,3,4,5,6"
    """run.sh: CUDA devices for torchrun, one training rank each."""
    vllm_gpu_memory_utilization: Annotated[float, "(0, 1]"] = 0.85
    """run.sh: `vllm serve --gpu-memory-utilization`."""
    # --- logging and checkpoints
    output_dir: str = ""
    """Run folder (empty = runs/<recipe name>)."""
    report_to: Annotated[str, ("none", "wandb")] = "none"
    """none | wandb (set WANDB_MODE=offline to log without network)."""
    wandb_project: str = "mt-grpo"
    """wandb project name."""
    tool_collapse_alarm: Annotated[float, "[0, 1)"] = 0.5
    """Warn (once, in the console and as alarm/tool_collapse) when the first turn's tool-call rate, averaged over
    `tool_collapse_steps` steps, falls below this fraction of its peak (0 = off); the run goes on."""
    tool_collapse_steps: Annotated[int, ">= 1"] = 5
    """Steps the tool-call rate is averaged over for the alarm."""
    log_episodes_steps: Annotated[int, ">= 0"] = 10
    """Dump the step's episodes, with the exact tensors trained, to episodes.jsonl every N steps (0 = off)."""
    save_steps: Annotated[int, ">= 0"] = 0
    """Save a checkpoint every N steps (0 = only at the end)."""
    resume_from_checkpoint: str = ""
    """'' (fresh run) | auto (the newest checkpoint in output_dir that verifies, if any) | PATH to a checkpoint
    folder."""


# === 2. Data types: what a rollout produces and the loss consumes ========================


@dataclass
class Completion:
    """One sampler reply."""

    ids: list[int]  # sampled token ids, verbatim (EOS / stop-completing token included)
    logprobs: list[float]  # log-probability of each sampled id under the sampling distribution
    finish_reason: str  # "stop" (EOS or a stop string) | "length" (max_tokens reached)
    version: int = 0  # policy version (weight syncs so far) when it was requested: its oldest token's


@dataclass
class Turn:
    """One assistant turn of an episode: `sampled_len` tokens sampled after a prompt of `prompt_len` tokens."""

    prompt_len: int
    sampled_len: int  # its ids and logprobs are in the sample that holds it, from `prompt_len` on
    state: bytes = b""  # state_key of the prompt's token ids: equal for turns sampled after exactly the same tokens


def state_key(ids) -> bytes:
    """The state a turn is sampled in, as a key: a digest of the token ids the sampler saw before it."""
    return hashlib.blake2b(np.asarray(ids, np.int64).tobytes(), digest_size=16).digest()


@dataclass
class Sample:
    """One training sequence. All per-token lists have the same length (I2)."""

    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)  # 1 = sampled by the policy (I1, I3)
    sampler_logprobs: list[float] = field(default_factory=list)
    turn_idx: list[int] = field(default_factory=list)  # assistant turn of the token, -1 if not sampled
    advantages: list[float] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # a token's weight in the loss: its node's leaves (see tree)
    n_messages: int = 0  # messages of the episode this sample covers
    last_prompt_len: int = 0  # tokens the sampler saw before this sample's last turn
    versions: list[int] = field(default_factory=list)  # policy version that sampled the token, -1 if not sampled
    text: str = ""  # the held text: dec(input_ids), kept as they grow
    prompt_chars: int = 0  # characters of `text` in the sampler's last prompt
    think_tokens: int = 0  # <think> tokens in that prompt
    episode_tokens: int = 0  # trained tokens of its episode's samples (0: its own)

    PER_TOKEN = ("input_ids", "loss_mask", "sampler_logprobs", "turn_idx", "versions")  # filled as the sample grows
    PROMPT_STATE = ("text", "prompt_chars", "think_tokens")  # what a next prompt sets beside the per-token lists

    def snapshot(self) -> dict:
        """What a next prompt may change, for `Episode.mark`: the per-token lists from the last turn on (a REALIGN may
        cut into them; what is before stays) and PROMPT_STATE."""
        tail = {k: getattr(self, k)[self.last_prompt_len :] for k in self.PER_TOKEN}
        state = {k: getattr(self, k) for k in self.PROMPT_STATE}
        return tail | state

    def restore(self, snapshot: dict):
        for k in self.PER_TOKEN:
            getattr(self, k)[self.last_prompt_len :] = snapshot[k]
        for k in self.PROMPT_STATE:
            setattr(self, k, snapshot[k])

    def truncate(self, n: int, text: str):
        for key in self.PER_TOKEN:
            del getattr(self, key)[n:]
        self.text = text

    def append(self, ids, mask: int, logprobs=None, turn: int = -1, version: int = -1):
        n = len(ids)
        if logprobs is None:  # context: no sampler logprob
            logprobs = [0.0] * n
        self.input_ids += ids
        self.loss_mask += [mask] * n
        self.sampler_logprobs += logprobs
        self.turn_idx += [turn] * n
        self.versions += [version] * n


@dataclass
class Episode:
    """One conversation: its messages (what the rewards see) and its samples (what the loss sees)."""

    row: dict
    messages: list[dict]  # prompt messages, then the conversation
    n_prompt_messages: int
    turns: list[Turn] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    done: bool = False
    end_reason: str = ""  # answer | no_action | empty | max_env_steps | truncated | context
    tool_calls: int = 0
    tool_errors: int = 0
    tool_names: list[str] = field(default_factory=list)  # per call that named one of the tools, that tool's name
    tool_output_replaced: int = 0  # characters of tool output the tokenizer could not take
    first_result_turn: int | None = None  # first assistant turn after a tool result
    forks: int = 0
    forks_harness_edit: int = 0  # of its forks, those after an agent harness edited its history (the rest: template)
    realigns: int = 0  # boundaries where REALIGN kept one sample (next_prompt)
    realigned_tokens: int = 0  # sampled tokens REALIGN turned into context (mask 0)
    rewards: dict[str, float] = field(default_factory=dict)
    turn_rewards: list[float] = field(default_factory=list)  # one per assistant turn; turn_reward is their sum
    turn_reward: float = 0.0
    outcome_reward: float = 0.0
    advantages: list[float] = field(default_factory=list)  # one per assistant turn (ep.turns): its tokens' advantage
    group: int = 0  # its prompt's place in the batch: the episodes of a group share the prompt
    node: tuple = ()  # branching: the path (root, child, ...) of the node that samples its next turn
    session: int = 0  # the sampler's key for it and its branches (a server keeps them on one server)
    turn_nodes: list[tuple] = field(default_factory=list)  # per assistant turn, the node that sampled it
    shared_tokens: int = 0  # sampled tokens it holds as context: the path it branched from trains them
    sampled_texts: dict[int, str] = field(default_factory=dict)  # message index -> the text its assistant turn sampled
    forced_text: str = ""  # text the generation prompt forced on the next turn, before what it samples
    boundaries: list[dict] = field(default_factory=list)  # one per turn boundary: kind (tool|user), extends
    thinking_tokens_kept: int = 0  # <think> tokens in the prompts the sampler saw
    tokenization_mismatches: int = 0
    rewritten: bool = False  # an agent harness edited the messages before this turn: render them in full
    UNDONE = (
        "forks",
        "forks_harness_edit",
        "realigns",
        "realigned_tokens",
        "thinking_tokens_kept",
    )  # counts a prompt that is undone raises

    @property
    def completion(self) -> list[dict]:
        return self.messages[self.n_prompt_messages :]

    def mark(self) -> tuple:
        """A branch point, from which `undo` takes the next prompt back: how many samples and boundaries the episode
        has, the counts a prompt may raise (UNDONE), and the snapshot of the held sample (a prompt grows it, or a
        REALIGN cuts it; a fork appends a new one, which `undo` drops)."""
        counts = {k: getattr(self, k) for k in self.UNDONE}
        held = None
        if self.samples:
            held = self.samples[-1].snapshot()
        return len(self.samples), len(self.boundaries), counts, held

    def undo(self, mark: tuple):
        n_samples, n_boundaries, counts, held = mark
        del self.samples[n_samples:]
        del self.boundaries[n_boundaries:]
        for k, value in counts.items():
            setattr(self, k, value)
        if held:
            self.samples[-1].restore(held)


def new_episode(row: dict, system_prompt: str, norm=lambda text: text) -> Episode:
    prompt = row["prompt"]
    if not isinstance(prompt, list):  # one user message
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt:
        prompt = [{"role": "system", "content": system_prompt}] + prompt
    msgs = [{**m, "content": norm(m["content"])} for m in prompt]  # each content is text (load_rows checks)
    return Episode(row=row, messages=msgs, n_prompt_messages=len(msgs))


# === 3. The method, as pure functions: rewards -> advantages -> per-token advantages -> loss ===


def score(episodes: list[Episode], funcs, weights, timeout: float, stop_event=None, per_turn=False):
    """Weighted sum of reward functions `fn(completions, **dataset_columns) -> list`, one value per episode; each
    function's own value goes to ep.rewards (the reward/* metrics). Outcome functions give numbers. With `per_turn`
    (turn functions) each episode's sum is a list, one per assistant turn: a function may give a list too, which adds
    turn by turn, or a number, which scores the turns before the first tool result and sits on the turn that called
    it (the last turn if none did). `call_reward` (appendix F) runs each one bounded by `timeout` seconds, on its own
    copies, and checks what it returns."""
    completions = [ep.completion for ep in episodes]
    columns = {}  # dataset column -> its value per episode
    for k in episodes[0].row:
        columns[k] = [ep.row.get(k) for ep in episodes]
    if per_turn:
        totals = [[0.0] * max(len(ep.turns), 1) for ep in episodes]
    else:
        totals = [[0.0] for _ in episodes]
    for fn, weight in zip(funcs, weights):
        name = reward_name(fn)
        values = call_reward(fn, completions, columns, timeout, stop_event, per_turn)
        for ep, total, value in zip(episodes, totals, values):
            ep.rewards[name] = value
            if isinstance(value, list):
                ep.rewards[name] = sum(value)
                per_turn_values = enumerate(value)
            elif per_turn:
                calling_turn = max(0, (ep.first_result_turn or len(ep.turns)) - 1)
                per_turn_values = [(calling_turn, value)]
            else:
                per_turn_values = [(0, value)]
            for turn, x in per_turn_values:
                total[turn] += weight * x
    if per_turn:
        return totals
    return [total[0] for total in totals]


# --- advantages: one group's episodes and rewards -> one advantage per assistant turn -> per-token advantages
# Why not normalise rewards per turn index across the group (verl RFC 7244), for any number of turns: that baseline's
# number of terms depends on where the trajectory stopped, a hidden bonus for taking another turn. A baseline from the
# turn's state (see the header) is unbiased: `tree`'s siblings (leave-one-out), or without branching the prompt's.


PerTurn = list[list[float]]  # per episode, one value per assistant turn (ep.turns)


def spread(values) -> bool:
    """Whether values differ by more than a float residue: 0.1 + 0.2 against 0.3 (5.6e-17), or float32's 0.1 + 0.25
    against 0.35 (~1e-8), would otherwise become a full advantage, or keep a group filter_zero_spread_groups drops."""
    v = np.asarray(values, float)
    if len(v) < 2:
        return False
    largest = max(1.0, float(np.abs(v).max()))  # a residue is relative to the largest value, or 1
    return np.ptp(v) > 1e-6 * largest


def group_normalize(rewards, scale: bool = True) -> np.ndarray:
    """(r - mean) / std within one group. A group with no spread gets exactly zero."""
    r = np.asarray(rewards, float)
    if not spread(r):
        return np.zeros_like(r)
    centred = r - r.mean()
    if scale:
        return centred / (r.std(ddof=1) + 1e-4)
    return centred


def mean_of_others(values) -> np.ndarray:
    """For each value, the mean of the other values: an unbiased baseline, as it does not depend on the value's own
    trajectory (GRPO's group mean includes it: the same up to a factor (n - 1) / n). No spread: the values themselves,
    so that each one's advantage is exactly zero."""
    v = np.asarray(values, float)
    if not spread(v):
        return v
    return (v.sum() - v) / (len(v) - 1)


def leave_one_out(values) -> np.ndarray:
    """Each value minus the mean of the others. No spread: exactly zero."""
    v = np.asarray(values, float)
    return v - mean_of_others(v)


def return_scale(turn_R, outcome_R, cfg: Config) -> float:
    """With scale_returns, the std of the group's returns (every turn reward and the outcome), which the per-turn modes
    divide by, as GRPO divides by its rewards' std; 1 without it, or when the returns do not spread. Off by default:
    the division is not unbiased (it reweighs decisions by up to 3.7x against each other in bench/credit_snr.py's
    processes), it raised the signal-to-noise per token in 3 of its 13 per-turn cases, and AdamW's step hardly
    depends on the reward's units."""
    returns = [sum(r) + o for r, o in zip(turn_R, outcome_R)]
    if cfg.scale_returns and spread(returns):
        return float(np.std(returns, ddof=1)) + 1e-4
    return 1.0


def mt_grpo_advantages(episodes: list[Episode], turn_R, outcome_R, cfg: Config) -> PerTurn:
    """MT-GRPO (paper Eq. 5): A_O + coef * A_T on the turns before the first tool result (every turn without one),
    A_O on the later ones."""
    turn_rewards = [sum(r) for r in turn_R]
    a_o = group_normalize(outcome_R, cfg.scale_rewards)
    a_t = cfg.turn_advantage_coef * group_normalize(turn_rewards, cfg.scale_rewards)
    advantages = []
    for ep, o, t in zip(episodes, a_o, a_t):
        split = ep.first_result_turn or len(ep.turns)  # the first turn after a tool result: A_O alone from it on
        before = [float(o + t)] * split
        after = [float(o)] * (len(ep.turns) - split)
        advantages.append(before + after)
    return advantages


def mt_grpo_merged_fallback_advantages(episodes: list[Episode], turn_R, outcome_R, cfg: Config) -> PerTurn:
    """MT-GRPO as the paper's released code computes it: an episode without a tool result gets GRPO-MR's merged
    advantage on every turn instead of A_O + coef * A_T (mt_grpo reads Eq. 5 literally: all its turns come before the
    first tool result)."""
    advantages = mt_grpo_advantages(episodes, turn_R, outcome_R, cfg)
    merged = grpo_merged_advantages(episodes, turn_R, outcome_R, cfg)
    for i, ep in enumerate(episodes):
        if not ep.first_result_turn:
            advantages[i] = merged[i]
    return advantages


def grpo_outcome_advantages(episodes: list[Episode], turn_R, outcome_R, cfg: Config) -> PerTurn:
    """GRPO-OR: the outcome reward only, on every turn."""
    outcome = group_normalize(outcome_R, cfg.scale_rewards)
    return on_every_turn(episodes, outcome)


def grpo_merged_advantages(episodes: list[Episode], turn_R, outcome_R, cfg: Config) -> PerTurn:
    """GRPO-MR: turn and outcome rewards merged into one scalar, on every turn."""
    turn_rewards = [sum(r) for r in turn_R]
    rewards = np.add(turn_rewards, outcome_R)
    merged = group_normalize(rewards, cfg.scale_rewards)
    return on_every_turn(episodes, merged)


def on_every_turn(episodes: list[Episode], values) -> PerTurn:
    """One value per episode, given to each of its turns."""
    per_turn = []
    for ep, value in zip(episodes, values):
        per_turn.append([float(value)] * len(ep.turns))
    return per_turn


def reward_to_go_advantages(episodes: list[Episode], turn_R, outcome_R, cfg: Config) -> PerTurn:
    """Per-turn rewards without branching: turn k gets its reward-to-go (its own and later turns' rewards, and the
    outcome) minus the mean return of the other episodes of its group. The prompt is the only state they share, so
    that is the baseline there is: unbiased, and a turn is no longer credited for the rewards before it. But that
    baseline holds the rewards the others earned before the turn, so a late turn's advantage is offset down by them:
    on the 3-hop task (docs/turn-credit.md) the answer turn's mean advantage was -1.1 and the agent stopped answering.
    With turn rewards that are large next to the outcome, branch (`tree`: its siblings are the turn's own state)."""
    returns = [sum(r) + o for r, o in zip(turn_R, outcome_R)]
    baselines = mean_of_others(returns)
    scale = return_scale(turn_R, outcome_R, cfg)
    advantages = []
    for ep, rewards, outcome, baseline in zip(episodes, turn_R, outcome_R, baselines):
        to_go = [sum(rewards[k:]) + outcome for k in range(len(ep.turns))]
        advantages.append([float((g - baseline) / scale) for g in to_go])
    return advantages


def tree_advantages(episodes: list[Episode], turn_R, outcome_R, cfg: Config) -> PerTurn:
    """Branching rollouts, any number of turns. A node is the run of turns one path samples between branch points
    (`ep.turn_nodes`); its value Q is its turns' rewards plus, below it, the mean Q of its children (a leaf: its
    episode's outcome). Its advantage is Q minus the mean Q of its siblings, which continued from the same tokens
    (leave-one-out: a baseline from the same state, unbiased however each path ends); every turn of a node, on every
    path through it, gets the node's advantage, divided by the group's return_scale. Without branching each episode is
    one node and this is GRPO-MR with a leave-one-out baseline."""
    node_rewards = {}  # node (its path from the root) -> its turns' rewards, once per episode through it
    leaf_outcome = {}  # leaf node -> its episode's outcome
    for ep, rewards, outcome in zip(episodes, turn_R, outcome_R):
        for depth in range(1, len(ep.node) + 1):
            node = ep.node[:depth]
            own = sum(x for x, n in zip(rewards, ep.turn_nodes) if n == node)
            node_rewards.setdefault(node, []).append(own)
        leaf_outcome[ep.node] = outcome

    def q(node):  # a node's turns' rewards (the mean over its paths: a number may sit on any turn), then what follows
        children = [c for c in node_rewards if c[:-1] == node]
        if children:
            rest = np.mean([q(c) for c in children])
        else:
            rest = leaf_outcome[node]
        return float(np.mean(node_rewards[node])) + rest

    values = {node: q(node) for node in node_rewards}
    scale = return_scale(turn_R, outcome_R, cfg)
    advantage = {}
    for parent in {node[:-1] for node in node_rewards}:
        siblings = [node for node in node_rewards if node[:-1] == parent]
        sibling_values = [values[node] for node in siblings]
        advantage.update(zip(siblings, leave_one_out(sibling_values) / scale))
    return [[float(advantage[n]) for n in ep.turn_nodes] for ep in episodes]


def state_matched_advantages(episodes: list[Episode], turn_R, outcome_R, cfg: Config) -> PerTurn:
    """Per-turn rewards, each turn against the other episodes of its group that were in exactly its state. Turn k's
    advantage is its reward-to-go minus the mean reward-to-go of the other episodes that sampled a turn after exactly
    the same token ids (`Turn.state`): the baseline of the turn's own state that branching buys with extra samples,
    found among independent episodes (they share the prompt, and the prefix up to where their calls or results
    differ). Where no other episode reached that state, the baseline is the mean reward-to-go of the others from the
    same turn index; where none has that turn, the mean return of the others (reward_to_go's). Every level is a
    function of other, independent episodes and of what the turn saw, never of the turn's own episode: unbiased."""
    returns = [sum(r) + o for r, o in zip(turn_R, outcome_R)]
    prompt_baselines = mean_of_others(returns)
    to_go = [[sum(r[k:]) + o for k in range(len(ep.turns))] for ep, r, o in zip(episodes, turn_R, outcome_R)]
    reached = collections.defaultdict(list)  # a state, or a turn index -> (episode, its reward-to-go from there)
    for i, ep in enumerate(episodes):
        for k, turn in enumerate(ep.turns):
            reached[turn.state].append((i, to_go[i][k]))
            reached[k].append((i, to_go[i][k]))
    scale = return_scale(turn_R, outcome_R, cfg)
    advantages = []
    for i, ep in enumerate(episodes):
        per_turn = []
        for k, turn in enumerate(ep.turns):
            same_state = [q for j, q in reached[turn.state] if j != i and turn.state]
            same_index = [q for j, q in reached[k] if j != i]
            baseline = np.mean(same_state or same_index or [prompt_baselines[i]])
            per_turn.append(float((to_go[i][k] - baseline) / scale))
        advantages.append(per_turn)
    return advantages


# advantage_mode -> fn(episodes, turn_R, outcome_R, cfg) -> one list per episode of a group, one advantage per assistant
# turn (ep.turns). turn_R: per episode, its turn rewards, one per turn; outcome_R: one per episode. The branch structure
# is ep.node and ep.turn_nodes. A new mode is one function and one entry here (from outside: M.ADVANTAGE_MODES[k] = fn).
ADVANTAGE_MODES = {
    "mt_grpo": mt_grpo_advantages,
    "mt_grpo_merged_fallback": mt_grpo_merged_fallback_advantages,
    "grpo_outcome": grpo_outcome_advantages,
    "grpo_merged": grpo_merged_advantages,
    "reward_to_go": reward_to_go_advantages,
    "tree": tree_advantages,
    "state_matched": state_matched_advantages,
}
INDEPENDENT_MODES = set(ADVANTAGE_MODES) - {"tree"}  # modes that take a group's episodes as independent of each other


def roots_per_prompt(cfg: Config) -> int:
    """Episodes started per prompt: G, or with branching G / branch_width^branch_depth (the tree's roots)."""
    return cfg.num_generations // cfg.branch_width**cfg.branch_depth


def node_weight(node: tuple, cfg: Config) -> float:
    """The leaves a node stands for in a full tree: b^(depth - its branchings). Its tokens, trained once, weigh that
    much, so the loss is the loss of the G root-to-leaf paths in expectation (however many of them a path that stopped
    early left unsampled); without branching, 1."""
    branchings = len(node) - 1  # the branch points on its path
    return float(cfg.branch_width ** (cfg.branch_depth - branchings))


def token_values(turn_idx, loss_mask, per_turn: list[float]) -> list[float]:
    """Per-token values of a per-turn list: a token's is its assistant turn's (`turn_idx` indexes `per_turn`), 0 on
    untrained tokens."""
    return [per_turn[turn] if trained else 0.0 for turn, trained in zip(turn_idx, loss_mask)]


def assign_advantages(episodes: list[Episode], turn_R: PerTurn, outcome_R: list[float], cfg: Config):
    """The heart of the method: per group (the episodes of one prompt), then per token. Writes each episode's rewards
    and its per-turn advantages, and every sample's per-token advantages and loss weights."""
    groups = {}  # group id -> its episodes, with their turn rewards and outcomes
    for ep, turn_rewards, outcome in zip(episodes, turn_R, outcome_R):
        groups.setdefault(ep.group, []).append((ep, turn_rewards, outcome))
    for members in groups.values():
        group = [ep for ep, _, _ in members]
        group_turn_R = [turn_rewards for _, turn_rewards, _ in members]
        group_outcome_R = [outcome for _, _, outcome in members]
        mode = ADVANTAGE_MODES[cfg.advantage_mode]
        per_turn = mode(group, group_turn_R, group_outcome_R, cfg)
        given = [len(a) for a in per_turn]
        turns = [len(ep.turns) for ep in group]
        if given != turns:
            raise ConfigError(
                f"advantage_mode {cfg.advantage_mode!r} must return one advantage per assistant turn: it gave "
                f"{given} for episodes of {turns} turns"
            )
        for (ep, turn_rewards, outcome), advantages in zip(members, per_turn):
            ep.turn_rewards = turn_rewards[: len(ep.turns)]
            ep.turn_reward = sum(turn_rewards)
            ep.outcome_reward = outcome
            ep.advantages = [float(a) for a in advantages]
            turn_weights = [1.0] * len(ep.turns)
            if ep.turn_nodes:
                turn_weights = [node_weight(n, cfg) for n in ep.turn_nodes]
            for s in ep.samples:
                s.advantages = token_values(s.turn_idx, s.loss_mask, ep.advantages)
                s.weights = token_values(s.turn_idx, s.loss_mask, turn_weights)


def trainable_samples(episodes: list[Episode], cfg: Config) -> tuple[list[Sample], int]:
    """The samples the loss sees, and how many held a non-finite sampler logprob (I6). Decided per node (a tree's
    unit, and without branching the whole episode): a node's tokens are left out where it sampled a non-finite logprob,
    and, with mask_truncated_completions, if a path cut by max_tokens or the context ended in it. A shared node's
    tokens are trained by one path, its first child's, and stay trained when that path is cut below the node: the node
    itself was sampled whole. Left out too: samples with nothing left to train. Each kept sample notes its episode's
    trained tokens over the kept samples (what sequence_mean divides by)."""
    kept = []
    rejected = 0
    for ep in episodes:
        nodes = collections.defaultdict(functools.partial(tuple, ep.node), enumerate(ep.turn_nodes))  # turn -> node
        cut = set()
        if cfg.mask_truncated_completions and ep.end_reason in ("truncated", "context"):
            cut.add(ep.node)  # the node the path ended in; its ancestors were sampled whole
        samples = []
        for s in ep.samples:
            broken = set()  # the nodes it sampled a non-finite logprob in
            for t, x in zip(s.turn_idx, s.sampler_logprobs):
                if t >= 0 and not math.isfinite(x):
                    broken.add(nodes[t])
            rejected += bool(broken)
            samples.append(without_nodes(s, nodes, broken | cut))
        samples = [s for s in samples if any(s.loss_mask)]
        episode_tokens = sum(sum(s.loss_mask) for s in samples)
        for s in samples:
            s.episode_tokens = episode_tokens
        kept += samples
    return kept, rejected


def without_nodes(s: Sample, nodes: dict, dropped: set) -> Sample:
    """The sample with the tokens of the `dropped` nodes as context (mask, weight and advantage 0, logprob 0.0: a
    non-finite one times mask 0 would still make the loss NaN), or the sample itself when nothing changes."""
    keep = [t >= 0 and nodes[t] not in dropped for t in s.turn_idx]
    mask = [m * k for m, k in zip(s.loss_mask, keep)]
    finite = all(map(math.isfinite, s.sampler_logprobs))
    if mask == s.loss_mask and finite:
        return s
    return dataclasses.replace(
        s,
        loss_mask=mask,
        weights=[w * k for w, k in zip(s.weights, keep)],
        advantages=[a * k for a, k in zip(s.advantages, keep)],
        sampler_logprobs=[x if k else 0.0 for x, k in zip(s.sampler_logprobs, keep)],
    )


# --- loss -------------------------------------------------------------------------------------


def token_mean(per_token, mask, seq_tokens, num_tokens: int, num_seqs: int):
    """Mean over every trained token of the batch (each token weighs the same, as in DAPO)."""
    total = (per_token * mask).sum()
    return total / max(num_tokens, 1)


def sequence_mean(per_token, mask, seq_tokens, num_tokens: int, num_seqs: int):
    """Mean over episodes of each episode's mean token loss (each episode weighs the same, as in the original GRPO):
    a row adds its masked sum over its episode's trained tokens, so a fork never changes an episode's weight."""
    row_sums = (per_token * mask).sum(-1)
    per_row = row_sums / seq_tokens.clamp(min=1)  # a row's share of its episode's mean
    return per_row.sum() / max(num_seqs, 1)


# loss_aggregation -> fn(per_token [B, T], mask [B, T], seq_tokens [B], batch's trained tokens, batch's sequences)
# -> scalar. A sequence is an episode: seq_tokens holds each row's episode's trained tokens (over all its samples),
# and the batch counts the episodes with a trained token, on every rank.
LOSS_AGGREGATIONS = {"token_mean": token_mean, "sequence_mean": sequence_mean}


def grpo_loss(
    logp, old_logp, sampler_logp, adv, mask, cfg: Config, num_tokens, num_seqs, seq_tokens=None, ref_logp=None
):
    """Token-level PPO-clip over `mask` tokens of a [B, T] micro-batch:

        loss_t = -min(r_t * A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) * A_t) * w_t + beta * KL_t,
        r_t = exp(logp_t - old_t),  w_t = min(exp(old_t - sampler_t), is_ratio_cap)  (detached; cap 0: w_t = 1)

    This is the decoupled PPO objective (Hilton et al. 2022, arXiv 2110.00641; AReaL, Fu et al. 2025, arXiv
    2505.24298), with the sampler as the behaviour policy mu and `old` as the proximal policy pi_old:

        J = E_{t ~ mu} [ min(pi_old / mu, cap) * min(r_t A_t, clip(r_t) A_t) ],   r_t = pi_theta / pi_old

    `old` is the trainer's own logprob before this batch's first update; `w_t` corrects for the sampler being another
    policy: slightly (bf16 on vLLM, other kernels), by design with top_p < 1 (the sampler reports the nucleus it drew
    from, the trainer scores the full distribution), and with max_staleness k >= 1 by up to k weight versions. With the
    whole batch's denominators, summed micro-batch losses give the whole batch's gradient (gradient accumulation).
    `seq_tokens` [B]: the trained tokens of each row's episode (None: each row is an episode of its own). From `cfg`:
    epsilon, epsilon_high, is_ratio_cap, beta, loss_aggregation. Returns the loss and sums over the masked tokens."""
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + cfg.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    is_weight = torch.zeros_like(logp)  # is_ratio_cap 0: no correction (logged as 0)
    if cfg.is_ratio_cap > 0:
        is_weight = torch.exp(old_logp - sampler_logp).clamp(max=cfg.is_ratio_cap)
        per_token = per_token * is_weight
    kl = torch.zeros_like(logp)
    if cfg.beta > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1  # k3 estimator of KL(pi || ref), >= 0
        per_token = per_token + cfg.beta * kl
    mask = mask.to(logp.dtype)
    if seq_tokens is None:
        seq_tokens = mask.sum(-1)
    loss = LOSS_AGGREGATIONS[cfg.loss_aggregation](per_token, mask, seq_tokens, num_tokens, num_seqs)
    with torch.no_grad():  # clipped: min takes the clipped term, so the token gets no policy gradient
        sums = {
            "loss/clip_frac": (clipped * adv < ratio * adv).to(mask.dtype),
            "loss/kl": kl,
            "loss/ratio": ratio,
            "loss/is_weight": is_weight,
            "rollout/sampler_logprob_diff": (old_logp - sampler_logp).abs(),  # the mismatch behind is_weight
        }
    token_sums = {k: (v * mask).sum() for k, v in sums.items()}
    return loss, token_sums


# === 4. Tool formats: how a call is written, parsed, and answered ========================

THINK_RE = re.compile(r"<think>.*?</think>\s*", re.S)


def parse_json(payload: str):
    """The JSON value, or the JSONDecodeError itself (run_tools reports it to the model)."""
    try:
        return json.loads(payload)
    except json.JSONDecodeError as e:
        return e


class XMLTools:
    """The paper's protocol: <reasoning>, then <tool>{"name", "args"}</tool> or <answer>...</answer>.
    Generation stops at </tool> or </answer>; a result comes back as a user message <result>...</result>."""

    args_key = "args"
    stop = ("</tool>", "</answer>")

    def __init__(self, tools):
        self.schemas = None  # the tools are described in the system prompt instead

    def parse(self, text: str) -> tuple[dict, list]:
        """Sampled text -> (the assistant message as the template gets it, the tool calls to run)."""
        calls = []  # one call a turn at most: generation stops at </tool>
        hit = re.search(r"<tool>(.*?)</tool>", text, re.S)
        if hit:
            calls.append(parse_json(hit.group(1)))
        return {"role": "assistant", "content": text}, calls

    def result(self, text: str) -> dict:
        return {"role": "user", "content": f"<result>\n{text}\n</result>"}

    def is_result(self, m: dict) -> bool:
        return m["role"] == "user" and m["content"].startswith("<result>")

    def is_answer(self, text: str) -> bool:
        return bool(re.search(r"<answer>.*?</answer>", text, re.S))


class NativeTools:
    """The chat template's own tool calling: JSON schemas in, <tool_call>{"name", "arguments"}</tool_call> (Qwen/Hermes)
    calls out, results as role 'tool'. Generation stops at EOS; a turn without a call is the answer."""

    args_key = "arguments"
    stop = ()

    def __init__(self, tools):
        self.schemas = [tool_schema(f) for f in tools] if tools else None

    def parse(self, text: str) -> tuple[dict, list]:
        sampled = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S)
        calls = [parse_json(c) for c in sampled]
        well_formed = all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls)
        if not calls or not well_formed:
            return {"role": "assistant", "content": text}, calls  # no call, or a bad one as sampled (run_tools says)
        # templates put one "\n" between content and the first call: that one is theirs, not content
        content = text[: text.index("<tool_call>")].removesuffix("\n")
        calls_msg = []
        for c in calls:
            function = {"name": c["name"], "arguments": c.get("arguments", {})}
            calls_msg.append({"type": "function", "function": function})
        message = {"role": "assistant", "content": content, "tool_calls": calls_msg}
        return message, calls

    def result(self, text: str) -> dict:
        return {"role": "tool", "content": text}

    def is_result(self, m: dict) -> bool:
        return m["role"] == "tool"

    def is_answer(self, text: str) -> bool:
        return True


# tool_format -> a class with: schemas, stop, args_key, parse, result, is_result (a message is one of its tool results,
# not a user query), is_answer; check-template also calls call_text, answer_text. A new format: a class, an entry here.
TOOL_FORMATS = {"xml": XMLTools, "native": NativeTools}


# === 5. The environment: rollouts, tool calls, and the token buffers that become samples ===


SESSIONS = itertools.count(1)  # every episode's sampler session, unique in this process


class MultiTurnToolEnv:
    """Rollouts with tools, and the token buffers that become samples (I1-I6): `next_prompt` grows a sample or forks
    one, `step` records a sampled turn, `run_tools` answers its calls. The chat template's side (rendering, the
    held text, the fast path at tool boundaries, the episode-end check) is `ChatTemplate`, in appendix G: method,
    not plumbing, kept there for its length."""

    def __init__(self, tokenizer, tools, cfg: Config):
        self.cfg = cfg
        self.tools = {fn.__name__: fn for fn in tools}
        self.fmt = TOOL_FORMATS[cfg.tool_format](tools)
        self.chat = ChatTemplate(tokenizer, self.fmt, cfg)
        self.stop = self.fmt.stop
        self.system_prompt = system_prompt_for(cfg, tools)

    @functools.cached_property
    def pool(self) -> DaemonPool:  # made on the first tool call: an env that runs no tool starts no threads
        return DaemonPool(32)

    def new_episode(self, row: dict) -> Episode:
        return new_episode(row, self.system_prompt, self.chat.norm)  # its prompts as the tokenizer reads them

    def next_prompt(self, ep: Episode) -> list[int]:
        """Extend the episode's sample with the environment's tokens, or fork a new one (I4).

        Worked example (ChatML, XML tools; [..] is a run of token ids, m = its loss mask):
          turn 0 prompt  P0 = "<|im_start|>user\\nq<|im_end|>\\n<|im_start|>assistant\\n"   [P0] m=0
          turn 0 sample  A0 = '<tool>{"name": "lookup", ...}</tool>'                       [A0] m=1 (ids as sampled)
          turn 1 render  R1 = P0 + A0 + "<|im_end|>\\n<|im_start|>user\\n<result>..." + "<|im_start|>assistant\\n"
          R1 starts with the held text P0 + A0: extend. Only the suffix S1 is tokenized.
                         sample = [P0][A0][S1], and the sampler is given exactly that.
          turn 1 sample  A1 = "<answer>v</answer>"            sample = [P0][A0][S1][A1]   (one sample: O(T))
        Had the template rewritten A0 in R1 (Qwen3 drops past <think> blocks at a new user query), R1 would not
        start with P0 + A0: the sample closes as [P0][A0] and a new one starts as [R1][A1] (a fork, counted in
        rollout/forks). Text, not ids, is compared: a valid non-canonical tokenization of A0 never forks.
        REALIGN: had R1 only dropped A0's trailing "\\n" (Llama 3.1 trims content), A0's tokens up to it stay
        trained and R1's rest is appended as context: [P0][A0 but "\\n"][S1'], one sample (see `realign_point`)."""
        chat = self.chat
        s = None  # the sample this prompt grows, if any
        bridged = None  # the fast path at a tool boundary; None: render it all
        if ep.samples:
            s = ep.samples[-1]
            bridged = chat.bridge(ep, s)
        text = bridged or chat.render(ep.messages, ep.sampled_texts)
        if self.cfg.thinking_retention == "template":
            ep.forced_text = ""
        else:
            ep.forced_text = chat.forced_prefix(ep.messages, ep.sampled_texts, text)
        if s:
            last_turn = max(ep.sampled_texts, default=-1)  # the message the last turn sampled
            since_last_turn = ep.messages[last_turn + 1 :]
            boundary = "user" if any(map(chat.is_query, since_last_turn)) else "tool"
            extends = text.startswith(s.text)
            realign = None
            if not extends:
                realign = chat.realign_point(s, text)
            gone = 0  # the last turn's sampled tokens REALIGN untrains
            if realign:
                gone = sum(s.loss_mask[realign[0] :])
                ep.realigns += 1
                ep.realigned_tokens += gone
                s.truncate(*realign)
            elif not extends:  # a fork: this sample closes
                ep.forks += 1
                if ep.rewritten:  # the harness changed what it was sent; else the template re-rendered what was sampled
                    ep.forks_harness_edit += 1
                s = None
            ep.boundaries.append({"turn": len(ep.turns), "kind": boundary, "extends": extends, "realigned": gone})
        if s is None:  # the episode's first prompt, or a fork
            s = Sample()
            ep.samples.append(s)
        # the environment's tokens (mask 0); <think> tokens are counted in what is new since the last prompt only
        new_text = text[s.prompt_chars :]
        for think in THINK_RE.findall(new_text):
            s.think_tokens += len(chat.enc(think))
        context = chat.enc(text[len(s.text) :])
        chat.append(s, context, mask=0)
        s.prompt_chars = len(s.text)
        ep.thinking_tokens_kept += s.think_tokens
        return list(s.input_ids)

    def step(self, ep: Episode, c: Completion) -> list:
        """Record one sampled turn, then decide: answer or end (returns []), or the tool calls to run."""
        t = len(ep.turns)
        s = ep.samples[-1]
        chat = self.chat
        s.last_prompt_len = len(s.input_ids)
        ep.turns.append(Turn(s.last_prompt_len, len(c.ids), state_key(s.input_ids)))
        ep.turn_nodes.append(ep.node)
        chat.append(s, c.ids, mask=1, logprobs=c.logprobs, turn=t, version=c.version)
        content_ids = c.ids
        if c.ids and c.ids[-1] in chat.tok.all_special_ids:  # the template adds EOS itself
            content_ids = c.ids[:-1]
        text = chat.dec(content_ids)
        msg, calls = self.fmt.parse(text)
        if len(msg.get("tool_calls", ())) > 1 and chat.one_call_per_turn:  # the sampled text and one error result (I6)
            err = f"this chat template takes one tool call per turn; this turn made {len(calls)}, and none of them ran"
            msg = {"role": "assistant", "content": text}
            calls = [ValueError(err)]
        ep.sampled_texts[len(ep.messages)] = ep.forced_text + text
        ep.messages.append(msg)
        s.n_messages = len(ep.messages)
        end_reason = ""  # the turn goes on to its tool calls
        if c.finish_reason == "length":
            end_reason = "truncated"  # a cut tool call is never run
        elif not text.strip():
            end_reason = "empty"  # nothing (or only EOS) was sampled
        elif not calls and self.fmt.is_answer(text):
            end_reason = "answer"
        elif not calls:
            end_reason = "no_action"
        elif ep.tool_calls + len(calls) > self.cfg.max_env_steps:  # every call counts, several in one turn too
            end_reason = "max_env_steps"
        if end_reason:
            ep.done = True
            ep.end_reason = end_reason
            return []
        if ep.first_result_turn is None:
            ep.first_result_turn = t + 1
        return calls

    def call_error(self, call) -> Exception | None:
        """What is wrong with a tool call as sampled, or None. `fmt.parse` gives a call that is not JSON as its
        JSONDecodeError, and `step` one error for a turn of more calls than the template takes."""
        key = self.fmt.args_key
        if isinstance(call, Exception):
            return call
        if not isinstance(call, dict) or "name" not in call:
            return ValueError(f'expected {{"name": ..., "{key}": {{...}}}}')
        if not isinstance(call["name"], str) or call["name"] not in self.tools:  # a name may be any JSON value
            return ValueError(f"unknown tool {call['name']!r}; tools: {', '.join(self.tools)}")
        if not isinstance(call.get(key, {}), dict):
            return ValueError(f"'{key}' must be a JSON object")

    def run_tools(self, pending: list[tuple[Episode, object]]) -> list[str]:
        """Run one turn's tool calls, all episodes' at once, appending each result to its episode. Every failure
        (bad JSON, unknown tool, wrong arguments, an exception, tool_timeout) is a counted error result (I6)."""
        errors = [self.call_error(call) for _, call in pending]  # what is wrong with each call as sampled, or None
        futures = []  # each call's running tool; None where it is wrong
        for (ep, call), error in zip(pending, errors):
            ep.tool_calls += 1
            future = None
            if error is None:
                # a copy: native calls keep these arguments in the assistant message, which the next prompt renders
                args = copy.deepcopy(call.get(self.fmt.args_key, {}))
                tool = self.tools[call["name"]]
                future = self.pool.submit(tool, **args)
                ep.tool_names.append(call["name"])
            futures.append(future)
        results = []
        for (ep, call), error, future in zip(pending, errors, futures):
            if future:
                try:
                    # The tool's own exception, even SystemExit or KeyboardInterrupt, is its result; a Ctrl-C that
                    # arrives while we wait is raised here, in the main thread, and stops the run.
                    error = self.pool.wait(future, self.cfg.tool_timeout)
                except concurrent.futures.TimeoutError:
                    error = TimeoutError(
                        f"tool {call['name']!r} did not finish within tool_timeout={self.cfg.tool_timeout}s"
                    )
            if error:
                ep.tool_errors += 1
                text = f"Error: {type(error).__name__}: {error}"
            elif future.result() is None:
                ep.tool_errors += 1
                text = "Error: the tool returned None"
            else:
                text = str(future.result())
            cap = self.cfg.tool_output_max_chars
            if len(text) > cap:
                text = text[:cap] + f"\n... [cut: {len(text) - cap} more characters]"
            clean = text.encode("utf-8", "replace").decode("utf-8")  # lone surrogates cannot be tokenized: '?'
            ep.tool_output_replaced += sum(a != b for a, b in zip(text, clean))
            results.append(self.chat.norm(clean))
            ep.messages.append(self.fmt.result(results[-1]))
        return results

    def rollout(
        self, rows: list[dict], sampler, generator=None, eval_temperature: float | None = None
    ) -> list[Episode]:
        """Run all episodes turn by turn; each turn samples every unfinished episode in one batch. `rows` holds each
        prompt roots_per_prompt times in a row; with branching, an episode goes on b ways after a tool result. An eval
        (`eval_temperature` set, 0 = greedy) runs one path per row, at that temperature."""
        active = eps = [self.new_episode(r) for r in rows]
        for i, ep in enumerate(eps):
            ep.group = i // roots_per_prompt(self.cfg)
            ep.node = (i,)
            ep.session = next(SESSIONS)
        server_room = getattr(sampler, "max_model_len", math.inf)  # a server's context may be less
        room = min(self.cfg.max_seq_len, server_room)
        evaluating = eval_temperature is not None
        temperature = eval_temperature if evaluating else self.cfg.temperature
        while active:
            prompts = []
            budgets = []
            for ep in active:
                mark = ep.mark()
                prompts.append(self.next_prompt(ep))
                room_left = room - len(prompts[-1])
                budgets.append(min(self.cfg.max_tokens, room_left))
                if budgets[-1] < 1:  # no room to sample: undo this prompt whole (a REALIGN's cut too), so no sample
                    ep.undo(mark)  # exceeds the room and every sampled token stays trained
                    ep.done = True
                    ep.end_reason = "context"
            live = [i for i, b in enumerate(budgets) if b >= 1]
            if live:
                outs = sampler.generate(
                    [prompts[i] for i in live],
                    [budgets[i] for i in live],
                    temperature=temperature,
                    top_p=self.cfg.top_p,
                    stop=self.stop,
                    generator=generator,
                    sessions=[active[i].session for i in live],
                )
                pending = []  # (episode, call) for each tool call of this turn
                for i, c in zip(live, outs):
                    ep = active[i]
                    for call in self.step(ep, c):
                        pending.append((ep, call))
                self.run_tools(pending)
                if self.cfg.branch_width > 1 and not evaluating:  # at the first branch_depth tool results of each path
                    called = {id(ep): ep for ep, _ in pending}  # each episode once, however many calls it made
                    for ep in called.values():
                        if len(ep.node) <= self.cfg.branch_depth:
                            eps = eps + self.branch(ep)
            active = [ep for ep in eps if not ep.done]
        eps.sort(key=lambda ep: ep.node)  # a group's episodes together, each path after the one it branched from
        for ep in eps:
            for s in ep.samples:
                lengths = {len(getattr(s, k)) for k in Sample.PER_TOKEN}
                assert len(lengths) == 1, "I2: out of step"
            ep.tokenization_mismatches = self.chat.check_tokenization(ep)
        return eps

    def branch(self, ep: Episode) -> list[Episode]:
        """After a tool result, the episode goes on branch_width ways from exactly its tokens (the same sampler
        context): it becomes the first child, and b - 1 copies the others. A copy holds the shared tokens as context
        (mask 0): each sampled token is trained once, by the path it stays on."""
        clones = []
        for j in range(1, self.cfg.branch_width):
            clone = copy.deepcopy(ep)
            clone.node = ep.node + (j,)
            for s in clone.samples:  # as context: mask 0, no turn, no sampler logprob, no version
                clone.shared_tokens += sum(s.loss_mask)
                n = len(s.input_ids)
                s.loss_mask = [0] * n
                s.turn_idx = [-1] * n
                s.sampler_logprobs = [0.0] * n
                s.versions = [-1] * n
            clones.append(clone)
        ep.node += (0,)
        return clones


# === 6. The train step: token logprobs, num_iterations optimizer updates on the batch's micro-batches ===


def token_logprobs(model, ids, attn, temperature: float):
    """log pi(token_t | tokens_<t) at `temperature` for every position of plain [B, T] rows; position 0 gets 0.
    `chunk_logprobs` (appendix D) computes them a chunk of tokens at a time, to bound the memory."""
    logits = model(input_ids=ids, attention_mask=attn).logits.flatten(0, 1)
    targets = ids.roll(-1, 1).flatten()  # next tokens; a row's last gets a dummy (its first), dropped below
    lp = chunk_logprobs(logits, targets, temperature).view_as(ids)
    scored = lp[:, :-1]  # position t scores token t + 1
    return torch.nn.functional.pad(scored, (1, 0))


def packed_logprobs(model, mb: dict, temperature: float):
    """Per-sample token logprobs [B, T] (0 where a sample trains nothing) from one forward over a micro-batch's rows
    (packed, see `pack_rows`, or padded): a trained token takes the logits at the trie node of the token before it,
    which samples sharing that prefix share, and its own sample's next token as the target."""
    out = model(input_ids=mb["ids"], attention_mask=mb["attn"], position_ids=mb["pos"])
    logits = out.logits.flatten(0, 1)
    lp = chunk_logprobs(logits[mb["src"]], mb["tgt"], temperature)
    flat = lp.new_zeros(mb["mask"].numel())  # every [B, T] position, 0 where nothing is trained
    flat = flat.index_put((mb["pick"],), lp)
    return flat.view_as(mb["mask"])


def train_on_samples(model, ref_model, optimizer, scheduler, samples: list[Sample], cfg: Config, pad_id: int) -> dict:
    """num_iterations optimizer updates on one rollout batch, accumulating over micro-batches. Each rank holds its
    own groups' samples; the loss is normalised by the global token and sequence counts and multiplied by the world
    size, because DDP and FSDP average gradients over ranks: N ranks give one process's update on the union."""
    device = next(model.parameters()).device
    world = dist.get_world_size() if dist.is_initialized() else 1
    # a sequence is an episode: its samples' shares of its trained tokens add up to 1 (round drops the float error)
    shares = []
    for s in samples:
        trained = sum(s.loss_mask)
        shares.append(trained / max(s.episode_tokens or trained, 1))
    weighted_tokens = sum(sum(s.weights or s.loss_mask) for s in samples)  # trained tokens, each counted by its weight
    num_tokens, num_seqs = map(round, all_reduce(weighted_tokens, sum(shares)))  # over every rank
    if num_tokens == 0:
        return {"loss/skipped_empty_batch": 1.0}
    model.train()
    mbs, info = prepare_microbatches(model, ref_model, samples, cfg, pad_id, device)
    sums = collections.Counter()  # means over the trained tokens and the iterations
    for _ in range(cfg.num_iterations):
        optimizer.zero_grad(set_to_none=True)
        for j, mb in enumerate(mbs):
            with gradient_sync(model, j == len(mbs) - 1):  # reduce over ranks once, after the last micro-batch
                with autocast(cfg, device):
                    logp = packed_logprobs(model, mb, cfg.temperature)
                loss, token_sums = grpo_loss(
                    logp,
                    old_logp=mb.get("old", logp.detach()),
                    sampler_logp=mb["sampler_logp"],
                    adv=mb["adv"],
                    mask=mb["mask"],
                    cfg=cfg,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                    seq_tokens=mb["seq_tokens"],
                    ref_logp=mb.get("ref"),
                )
                (loss * world).backward()
            sums["loss/policy"] += loss.item() / cfg.num_iterations
            for k, v in token_sums.items():
                sums[k] += v.item() / num_tokens / cfg.num_iterations
        max_norm = cfg.max_grad_norm or math.inf  # 0: no clipping
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm)
        optimizer.step()
        scheduler.step()
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    m = dict(zip(sums, all_reduce(*sums.values())))
    m["loss/grad_norm"] = float(grad_norm)
    m["loss/lr"] = scheduler.get_last_lr()[0]
    return m | info


# === 7. The training loop ================================================================


def collect(run, step: int) -> tuple[list[Episode], dict]:
    """Steps 1-3 for this rank's groups: rollout -> reward -> advantage. With filter_zero_spread_groups (DAPO's dynamic
    sampling) a group whose episodes all get zero advantage, which teaches nothing and dilutes the batch, is dropped
    and new prompts are rolled out in its place, for up to max_filter_draws more rounds; then the last round's
    dropped groups fill what is still missing (they add only the KL term)."""
    cfg = run.cfg
    roots = roots_per_prompt(cfg)
    t0 = time.time()
    rows = run.batch(step)
    wanted = len(rows) // roots  # groups this rank trains
    kept = []  # groups to train
    no_spread = []  # the last round's groups that teach nothing (every advantage zero), when filtering
    drawn = []  # the outcomes of every group rolled out, per group
    extra = 0  # prompts drawn beyond the batch
    draws = 1
    if cfg.filter_zero_spread_groups:
        draws += cfg.max_filter_draws
    for draw in range(draws):
        # 1. rollout: whole groups (a prompt's episodes, or its tree's paths), every episode turn by turn, all at once
        generator = run.generator(step, draw)
        episodes = run.env.rollout(rows, run.sampler, generator)
        # 2. reward: turn-level rewards (one per turn) and an outcome-level scalar per episode
        turn_R = score(episodes, run.turn_fns, run.turn_w, cfg.reward_timeout, run.stop_event, per_turn=True)
        outcome_R = score(episodes, run.outcome_fns, run.outcome_w, cfg.reward_timeout, run.stop_event)
        # 3. advantage: one per assistant turn, from its group (see ADVANTAGE_MODES), which its tokens take
        assign_advantages(episodes, turn_R, outcome_R, cfg)
        by_group = itertools.groupby(episodes, key=lambda ep: ep.group)
        groups = [list(g) for _, g in by_group]
        no_spread = []
        for g in groups:
            drawn.append([ep.outcome_reward for ep in g])
            if cfg.filter_zero_spread_groups and not any(any(ep.advantages) for ep in g):
                no_spread.append(g)
            else:
                kept.append(g)
        missing = wanted - len(kept)
        if not missing or draw == cfg.max_filter_draws:
            break
        rows = run.batch(step, draw + 1)[: missing * roots]
        extra += missing
    groups = kept + no_spread[:missing]
    for i, group in enumerate(groups):  # the step's groups, numbered anew across draws
        for ep in group:
            ep.group = i
    m = {"time/rollout": time.time() - t0}
    if cfg.filter_zero_spread_groups:  # reward/outcome covers the groups trained, this one every episode rolled out
        m["rollout/groups_filtered"] = len(drawn) - len(kept)
        m["rollout/extra_draws"] = extra
        m["reward/outcome_before_filter"] = float(np.mean(np.concatenate(drawn)))
    return [ep for g in groups for ep in g], m


def train(cfg: Config, eval_only: bool = False) -> list[dict]:
    """The whole run. Returns the logged metrics, one dict per step."""
    run = setup(cfg, eval_only)  # plug-ins checked, model built/loaded/resumed, sampler synced (appendix A)
    if eval_only:
        return run.close([evaluate(run, run.start, record=True)])
    try:
        if run.start == 0 and run.eval_due(0):  # the model before training: a row of its own, where "before" starts
            run.logger.log_eval(0, evaluate(run, 0))
        for step in run.steps:
            t0 = time.time()
            # 1-3. rollout -> reward -> advantage (`collect`, above), for this rank's groups: run now, or, with
            #      max_staleness >= 1, already run by the producer thread while the trainer updated on earlier steps
            try:
                episodes, m_roll = run.rollouts.take(step)
            except Stopped:  # a signal while a reward function ran (it may never return): this step is dropped
                episodes = None
            if all_reduce(float(episodes is None))[0]:  # on any rank: all ranks stop, with the weights of `step` steps
                run.save_and_stop(step)
                break
            # 4. update: PPO-clip on exactly the sampled tokens (I1)
            samples, rejected = trainable_samples(episodes, cfg)
            t1 = time.time()
            m = train_on_samples(
                model=run.policy,
                ref_model=run.ref_model,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                samples=samples,
                cfg=cfg,
                pad_id=run.pad_id,
            )
            t_train = time.time() - t1
            # 5. sync: a sampler with weights of its own (a vLLM server) samples from the new ones from now on
            if (step + 1) % cfg.sync_every == 0:
                m.update(run.sync(step + 1))
                run.rollouts.advance()
            # 6. log: every rank's means, averaged on rank 0; evaluate when due
            m.update(episode_metrics(episodes))
            m.update(m_roll)
            m.update(getattr(run.sampler, "stats", dict)())
            m.update(getattr(run.env, "stats", dict)())  # an agent harness's endpoint
            m["rollout/rejected_nonfinite"] = rejected
            m["time/train"] = t_train
            m["time/step"] = time.time() - t0
            m_eval = {}
            if run.eval_due(step + 1):
                m_eval = evaluate(run, step + 1)
            run.logger.log(step + 1, m, episodes, m_eval)
            # 7. save: every save_steps, at the end, and on SIGTERM or Ctrl-C (every rank stops at the same step)
            if (cfg.save_steps and (step + 1) % cfg.save_steps == 0) or step + 1 == cfg.max_steps:
                run.save(step + 1)
            if run.stop_requested():
                run.save_and_stop(step + 1)
                break
    except BaseException:  # a run that failed: its lock goes, and before its first step, the earlier run comes back
        run.release()
        raise
    finally:  # the producer thread (max_staleness >= 1) stops with the loop, however it ends
        run.rollouts.close()
    return run.close(run.logger.history)


# === 8. CLI ==============================================================================


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        try:
            return print_help()
        except BrokenPipeError:  # `--help | head` stopped reading: it has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the flush at exit raises it again
            return None
    # tools around training live beside this file, off its path
    if argv[0] in ("check-template", "merge-lora", "plot", "show"):
        tool = load_object(f"{argv[0].replace('-', '_')}.py:main", argv[0])
        sys.exit(tool(argv[1:]))
    eval_only = argv[0] == "eval"
    if argv[0] in ("train", "eval"):
        argv = argv[1:]
    recipe = None  # only key=value overrides: the default recipe
    if argv and "=" not in argv[0]:
        recipe = argv[0]
    try:
        say = print if os.environ.get("RANK", "0") == "0" else None
        cfg = load_config(recipe, argv[1:] if recipe else argv, say)
        train(cfg, eval_only)
        if "RANK" in os.environ:  # under torchrun: skip C++ teardown, where gloo's threads can abort a finished rank
            exit_now(0)
    except (ConfigError, TokenizationMismatch, SamplerError, SyncCheckError, CheckpointError, HarnessFailed) as e:
        where = f" (rank {os.environ['RANK']})" if "RANK" in os.environ else ""
        print(f"mt-grpo: error{where}: {e}", file=sys.stderr)  # exit_now flushes
        exit_now(1)
    except KeyboardInterrupt:
        print("\nmt-grpo: aborted by a second Ctrl-C, mid-step; saved checkpoints are unaffected", file=sys.stderr)
        exit_now(130)
    except BaseException:
        if dist.is_initialized():  # torchrun stops the other ranks once this one exits: never a hang
            traceback.print_exc()
            exit_now(1)
        raise


# APPENDIX: plumbing ###################################################################################
# Nothing below changes the method but appendix G, the chat template's side of `next_prompt` (I4, I5: which tokens a
# sample holds), kept there because it is long; read the rest when you change how a run is set up, logged, sampled,
# distributed or saved.

# === A. Run set-up: everything the loop needs, checked in order of cost ==================


def follow_slope(srv_change: torch.Tensor, own_change: torch.Tensor, noise: float) -> tuple[float, float]:
    """The least-squares slope (through 0) of the server's per-token logprob change on the trainer's, and its standard
    error when each token's change may carry `noise` (a variance) of its own (infinite while the trainer's is 0)."""
    own_sq = float(own_change.square().sum())
    if own_sq == 0:
        return 0.0, math.inf
    return float((srv_change * own_change).sum()) / own_sq, math.sqrt(noise / own_sq)


def step_seed(seed: int, step: int, draw: int = 0, rank: int = 0) -> int:
    """The seed of one step's prompt draw and sampling: a function of the run's seed, the step, the dynamic-sampling
    redraw and the rank alone, so a resumed run draws as an unbroken one. Large primes keep the streams apart."""
    stream = 100_003 * rank + 7_919_993 * draw  # each rank's, each redraw's
    return seed * 1_000_003 + step + stream


def rows_for_step(rows: list[dict], cfg: Config, step: int, draw: int = 0) -> list[dict]:
    """P prompts for this step (draw > 0: a dynamic-sampling redraw), each repeated roots_per_prompt times (G without
    branching). They depend only on (seed, step, draw), never on what ran before: a resumed run neither repeats nor
    skips a prompt."""
    rng = random.Random(step_seed(cfg.seed, step, draw))
    P = cfg.prompts_per_step
    if len(rows) >= P:
        picked = rng.sample(rows, P)
    else:  # fewer rows than prompts: repeats
        picked = rng.choices(rows, k=P)
    roots = roots_per_prompt(cfg)
    return [r for r in picked for _ in range(roots)]


@dataclass
class Run:
    """What `train()` uses: plug-ins, model and optimizer, environment, sampler, logger, rank, start step, signals.
    `setup` sets the fields from `tools` on, in the order listed; until then each holds its default."""

    cfg: Config
    rank: int
    world: int
    device: torch.device
    is_main = property(lambda self: self.rank == 0)  # rank 0 prints, writes the run folder and talks to the server
    stop_event: threading.Event = field(default_factory=threading.Event)  # SIGTERM or a first Ctrl-C sets it
    stop_signal: str = ""  # the name of the signal that set it
    tools: list[typing.Callable] = field(default_factory=list)
    agent: typing.Callable | None = None  # an agent harness (cfg.agent), which runs its own tools; None for a command
    turn_fns: list[typing.Callable] = field(default_factory=list)  # turn-level reward functions
    outcome_fns: list[typing.Callable] = field(default_factory=list)  # outcome-level reward functions
    turn_w: list[float] = field(default_factory=list)  # the weights of turn_fns
    outcome_w: list[float] = field(default_factory=list)  # the weights of outcome_fns
    rows: list[dict] = field(default_factory=list)  # the dataset
    eval_rows: list[dict] = field(default_factory=list)  # the rows evaluated (of eval_dataset)
    lock: typing.TextIO | None = None  # rank 0's hold on output_dir (see hold_output_dir)
    earlier: str = ""  # where this fresh run moved an earlier run in output_dir (put back if it trains no step)
    src: str = ""  # where the weights came from: a checkpoint or the model
    tokenizer: typing.Any = None  # a transformers tokenizer
    model: torch.nn.Module | None = None  # the HF (or peft) module: what is saved and synced
    ref_model: torch.nn.Module | None = None  # the frozen reference (beta > 0); with LoRA `model`
    policy: torch.nn.Module | None = None  # `model` wrapped in DDP or FSDP2: what the loss runs
    optimizer: torch.optim.Optimizer | None = None
    scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
    start: int = 0  # the step the run starts from (a checkpoint's)
    saved: dict[int, str] = field(default_factory=dict)  # step -> the checkpoint that holds it: resumed or saved
    env: MultiTurnToolEnv | None = None
    pad_id: int = 0  # the token that pads micro-batches
    sampler: LocalSampler | VLLMServerClient | None = None  # or any class with the interface of appendix C
    probe_ids: list[int] = field(default_factory=list)  # the weight-sync check's fixed sequence
    probe_ref: dict = field(default_factory=dict)  # per server, its references (version, its, trainer's): first, last
    steps: typing.Any = None  # a tqdm over the steps to run
    logger: MetricsLogger | None = None  # None with the eval command
    rollouts: RolloutProducer | None = None
    handlers: dict = field(default_factory=dict)  # the signal handlers on_signal replaced (close restores)

    def say(self, msg: str):
        if self.is_main:
            print(msg, flush=True)

    def batch(self, step: int, draw: int = 0) -> list[dict]:
        per_rank = self.cfg.prompts_per_step * roots_per_prompt(self.cfg) // self.world
        return rows_for_step(self.rows, self.cfg, step, draw)[self.rank * per_rank : (self.rank + 1) * per_rank]

    def generator(self, step: int, draw: int = 0) -> torch.Generator:
        seed = step_seed(self.cfg.seed, step, draw, self.rank)
        return torch.Generator(device=self.device).manual_seed(seed)

    def sync(self, version: int) -> dict:
        """A sampler with weights of its own (servers) samples from the current ones from now on; then every server is
        checked on a probe sequence (a failed, partial or skipped reload would otherwise train silently off-policy):
        see check_probe. A server that dies during the check is down like any other, and checked once taken back."""
        if self.sampler.policy_version is None:  # in-process: it samples from the weights being trained
            return {}
        t = time.time()
        sd, _ = full_state(self.model, None, self.cfg.fsdp)
        if dist.is_initialized() and not self.is_main:
            dist.barrier()  # the other ranks follow once rank 0's call returned: the server holds the new weights
        self.sampler.sync_weights(self.model, sd if self.is_main else None, version)
        if dist.is_initialized() and self.is_main:
            dist.barrier()
        m = {"time/weight_sync": time.time() - t}
        if not self.cfg.sync_check:  # the recipe turned it off (said at start)
            return m
        if self.is_main and not self.probe_ref:  # the first check: the probe goes on with 4 texts the policy samples
            for sampled in self.sampler.generate([self.probe_ids] * 4, [64] * 4, 1.0, 1.0):
                self.probe_ids = self.probe_ids + sampled.ids
            self.probe_ids = self.probe_ids[-256:]
        ids = torch.tensor([self.probe_ids], device=self.device)
        was = self.model.training
        with torch.no_grad():  # every rank runs the forward (FSDP); float32, no dropout, as the server
            own = token_logprobs(self.model.eval(), ids, torch.ones_like(ids), 1.0)[0, 1:].double().cpu()
        self.model.train(was)
        stats = [0.0] * 9  # rank 0's: check_probe's of the server farthest from the trainer, and how many it checked
        if self.is_main:
            checks = []
            for url, logprobs in self.sampler.probe_logprobs(self.probe_ids).items():  # the servers that answered
                checks.append(self.check_probe(url, version, torch.tensor(logprobs, dtype=torch.float64), own))
            stats = [*max(checks), len(checks)]
        diff, change, *follow, checked = all_reduce(*stats)
        m.update({"sync/probe_logprob_diff": diff, "sync/probe_change": change, "sync/servers_checked": checked})
        for name, (slope, se, judged) in zip(("probe_follow", "probe_follow_run"), (follow[:3], follow[3:])):
            if judged:
                m[f"sync/{name}"] = slope
                m[f"sync/{name}_se"] = se
        return m

    def check_probe(self, url: str, version: int, srv, own) -> list[float]:
        """One server's sync check (rank 0). Its logprobs must be within sync_check_max_diff of the trainer's (0: no
        bound), and must have moved as far as the trainer's did: the least-squares slope of the server's per-token change
        on the trainer's is 1 when the reload took, 0 when it did nothing, between when it left some tensors old. Only
        a slope below its band stops the run: a reload fault loses change, and bf16's rounding of a small change overshoots
        (1.74 after 14 steps at lr 2e-6 on SmolLM2-135M, bench/real_model.py). bf16
        arithmetic and read noise (a GPU vLLM is not batch-invariant) scatter it, so a span is judged once the slope's
        standard error is a fifth of its tolerance; until then changes add up. Since the last judged sync (a skipped
        reload) the tolerance is 0.5, and a server that repeats its logprobs to the bit is judged at once; since the
        server's first sync (a partial reload, whose missed change adds up) 0.1. Returns the mean |server - trainer|, the trainer's mean |change| since the last judged sync, then per
        span the slope, its standard error and whether it was judged."""
        diff = float((srv - own).abs().mean())
        bound = self.cfg.sync_check_max_diff
        if bound and diff > bound:
            raise SyncCheckError(
                f"weight sync check failed after step {version} on {url}: on a {len(self.probe_ids)}-token probe "
                f"the server's logprobs differ from the trainer's by {diff:.4f} on average (sync_check_max_diff="
                f"{bound}). Likely: a failed or partial reload (see the server's log), another model on the server, "
                "or a larger precision gap (raise the bound)."
            )
        first, last = self.probe_ref.setdefault(url, [(version, srv, own)] * 2)
        # What bf16 (its rounding moves with the weights) and read noise may give a token's change: twice the mean
        # square of the first sync's gap, read through the same noise. The scatter about the line would understate it:
        # a few weights whose bf16 rounding flips move many tokens together.
        noise = 2 * float((first[1] - first[2]).square().mean())
        recent, recent_se = follow_slope(srv - last[1], own - last[2], noise)
        whole, whole_se = follow_slope(srv - first[1], own - first[2], noise)
        change = float((own - last[2]).abs().mean())
        # A server that repeats its logprobs to the bit (the CPU build) has no read noise, and any change of its bf16
        # weights moves its logprobs (measured down to a change of a 600th of the gap; at a 2000th not always).
        if torch.equal(srv, last[1]) and change > diff / 50:
            recent_se = 0.0
        out = [diff, change]
        for since, slope, se, tolerance in ((last[0], recent, recent_se, 0.5), (first[0], whole, whole_se, 0.1)):
            judged = se <= tolerance / 5
            out += [slope, se, float(judged)]
            if judged and slope < 1 - tolerance:
                raise SyncCheckError(
                    f"weight sync check failed after step {version} on {url}: since step {since} the server's "
                    f"logprobs on a {len(self.probe_ids)}-token probe moved {slope:.2f} times as far as the trainer's "
                    f"(standard error {se:.2f}; a reload that took moves them at least {1 - tolerance} times as far). Likely: "
                    "a reload that did not take, or a partial one (some tensors kept their old values; see the "
                    "server's log), or the server serves something else."
                )
        if out[4]:  # judged: the span since the last judged sync starts again here
            self.probe_ref[url] = [first, (version, srv, own)]
        return out

    def check_logprobs_mode(self, prompt: list[int]):
        """A server started without `--logprobs-mode processed_logprobs` returns vLLM's raw logprobs (temperature 1, no
        top-p) while the trainer scores at the recipe's temperature: every importance weight would be biased. Four short
        samples at the recipe's temperature and top_p tell which the server returns."""
        cfg = self.cfg
        if cfg.temperature == 1.0 and cfg.top_p == 1.0:  # nothing processed: the two modes agree
            return
        srv = []
        raw = []
        processed = []
        for c in self.sampler.generate([prompt] * 4, [16] * 4, cfg.temperature, cfg.top_p):  # each rank its own
            ids = torch.tensor([prompt + c.ids], device=self.device)
            with torch.no_grad():  # every rank runs the same number of forwards (FSDP)
                logits = self.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().cpu()
            pick = torch.tensor(c.ids, dtype=torch.long)[:, None]
            lp = torch.log_softmax(logits / cfg.temperature, -1)
            raw += torch.log_softmax(logits, -1).gather(-1, pick).squeeze(-1).tolist()
            processed += (top_p_filter(lp, cfg.top_p) if cfg.top_p < 1 else lp).gather(-1, pick).squeeze(-1).tolist()
            srv += c.logprobs
        ok = [i for i, p in enumerate(processed) if math.isfinite(p)]  # not at the edge of the trainer's nucleus
        gaps = [sum(abs(srv[i] - x[i]) for i in ok) for x in (raw, processed)]
        n, to_raw, to_processed = all_reduce(len(ok), *gaps)
        if to_raw < to_processed / 2:  # clearly closer to the raw ones
            raise SamplerError(
                f"the vLLM server at {self.sampler.url} returns logprobs at temperature 1 without top-p, not "
                f"at temperature={cfg.temperature}, top_p={cfg.top_p} as it samples: on {n:.0f} sampled tokens "
                f"they differ from the trainer's by {to_processed / n:.3f} on average, from its temperature-1 "
                f"logprobs by {to_raw / n:.3f}. Restart it with `--logprobs-mode processed_logprobs` (run.sh "
                "adds it), else every importance weight is biased."
            )

    def on_signal(self, signum, frame):
        """SIGTERM or a first Ctrl-C: finish the step (or drop it, if a reward function is running), save, exit (no more
        server retries); a second Ctrl-C aborts."""
        if signum == signal.SIGINT and self.stop_event.is_set():
            raise KeyboardInterrupt
        self.stop_signal = signal.Signals(signum).name
        self.stop_event.set()
        if signum == signal.SIGINT:
            self.say(
                "\n[mt-grpo] Ctrl-C: finishing this step (dropping it if a reward function is running), then "
                "saving a checkpoint; Ctrl-C again aborts at once"
            )

    def save(self, step: int) -> str:
        """Save the weights after `step` steps; returns the checkpoint's path."""
        path = save_checkpoint(self.cfg, step, self.model, self.tokenizer, self.optimizer, self.scheduler)
        self.saved[step] = path
        return path

    def save_and_stop(self, step: int):
        """SIGTERM or a first Ctrl-C, on any rank: save the weights after `step` steps, unless this run already has
        (save_steps, or the checkpoint it resumed); the loop ends there. What was saved decides, never arithmetic."""
        path = self.saved.get(step) or self.save(step)
        self.say(
            f"\n[mt-grpo] {self.stop_signal or 'a signal on another rank'}: stopped after step {step} and saved "
            f"{path}; continue with resume_from_checkpoint=auto"
        )

    def release(self):
        """Rank 0, however the run ends: a fresh run that trained no step (nothing but its config.yaml and its
        evaluation at step 0; no checkpoint saved) puts back the earlier run it moved aside, and the lock file goes."""
        trained = self.logger and any(h["step"] for h in self.logger.history)
        untrained = {"config.yaml", "eval", "metrics.jsonl"}  # what a run writes before its first step
        if self.earlier and not trained and not set(os.listdir(self.cfg.output_dir)) - untrained:
            shutil.rmtree(self.cfg.output_dir, ignore_errors=True)
            os.replace(self.earlier, self.cfg.output_dir)
            print(f"[mt-grpo] this run trained no step, so the earlier run is back in {self.cfg.output_dir}")
        self.earlier = ""
        if self.lock:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.lock.name)
            self.lock.close()
            self.lock = None

    def eval_due(self, step: int) -> bool:
        return bool(self.eval_rows and self.cfg.eval_steps and step % self.cfg.eval_steps == 0)

    def stop_requested(self) -> bool:
        return all_reduce(float(self.stop_event.is_set()))[0] > 0  # any rank's signal stops every rank

    def close(self, history: list[dict]) -> list[dict]:
        if self.logger:
            for sig, handler in self.handlers.items():
                signal.signal(sig, handler)
            self.steps.close()
            if self.logger.wandb:
                self.logger.wandb.finish()
            if self.is_main:
                summarize(self.cfg, history, self.logger.failing)
        self.sampler.close()
        if isinstance(self.env, AgentEnv):
            self.env.close()  # its harnesses' worker processes
        self.release()
        if dist.is_initialized():
            dist.barrier()  # tearing gloo down while a peer still uses it can abort that peer ("terminate called ...")
            dist.destroy_process_group()
        return history


def setup(cfg: Config, eval_only: bool = False) -> Run:
    """Plug-ins and rewards first (a bad recipe fails in seconds), then the run folder, the model
    (built if missing), the optimizer and resume state, the sampler and its first weight sync."""
    resolve_paths(cfg)
    run = Run(cfg, *init_distributed(cfg))
    try:
        return prepare_run(run, eval_only)
    except BaseException:  # a run that fails before its first step: its lock goes, and the earlier run comes back
        run.release()
        raise


def prepare_run(run: Run, eval_only: bool) -> Run:
    cfg = run.cfg
    random.seed(cfg.seed + run.rank)
    np.random.seed((cfg.seed + run.rank) % 2**32)
    torch.manual_seed(cfg.seed + run.rank)
    load_plugins(run, eval_only)
    ckpt = find_checkpoint(cfg, run.say)
    if eval_only and not ckpt and cfg.resume_from_checkpoint == "auto":  # asked for a trained model: never the base
        raise ConfigError(
            f"eval with resume_from_checkpoint=auto: '{cfg.output_dir}' holds no checkpoint, so it would evaluate the "
            f"untrained {cfg.model_name_or_path}. Set output_dir to the trained run's folder, or drop "
            "resume_from_checkpoint to evaluate the untrained model"
        )
    if run.is_main:
        try:
            run.lock = None if eval_only else hold_output_dir(cfg, run.say)
            run.earlier = prepare_output_dir(cfg, ckpt, eval_only, run.say)
        except OSError as e:
            raise ConfigError(
                f"cannot write the run folder '{cfg.output_dir}': {e.strerror or e}; set output_dir to "
                "a folder you can write to"
            ) from None
        build_model_if_missing(cfg, run.say)
    if dist.is_initialized():
        dist.barrier()  # the model folder exists for every rank
    run.src = ckpt or cfg.model_name_or_path
    models = load_models(cfg, run.src, run.device, run.say)
    run.tokenizer, run.model, run.ref_model, run.policy, run.optimizer, run.scheduler = models
    if ckpt:
        run.start = restore(cfg, ckpt, run.model, run.optimizer, run.scheduler, run.world, run.is_main)
        run.saved[run.start] = ckpt
        run.say(f"[mt-grpo] resumed from {ckpt} at step {run.start}")
    run.env = MultiTurnToolEnv(run.tokenizer, run.tools, cfg)
    if cfg.agent or cfg.agent_command:
        run.env = AgentEnv(run.tokenizer, run.agent, cfg)
    run.pad_id = run.tokenizer.pad_token_id if run.tokenizer.pad_token_id is not None else run.tokenizer.eos_token_id
    run.sampler = (
        VLLMServerClient(cfg, run.model.config.vocab_size, eos_ids(run.model, run.tokenizer), run.stop_event, run.say)
        if cfg.vllm_server_url
        else LocalSampler(run.model, run.tokenizer)
    )  # a new sampler: a line here
    prompt_ids = run.env.chat.enc(run.env.chat.render(run.env.new_episode(run.rows[0]).messages, {}))
    run.probe_ids = prompt_ids  # the sync check's fixed sequence starts with the first prompt (see Run.sync)
    run.sync(run.start)  # a server may hold other weights (another run's, or not this checkpoint's)
    if eval_only:  # no training: no logprobs to check
        return run
    if run.sampler.policy_version is not None:  # in-process they are the trainer's
        run.check_logprobs_mode(prompt_ids)
    quiet = not run.is_main or not sys.stderr.isatty()  # the step lines say it all in a file; a bar would tangle them
    bar = {"initial": run.start, "total": cfg.max_steps, "desc": "mt-grpo", "dynamic_ncols": True, "disable": quiet}
    run.steps = tqdm(range(run.start, cfg.max_steps), **bar)
    run.logger = MetricsLogger(cfg, run.rank, run.world, run.start, run.steps.write)
    run.rollouts = RolloutProducer(run, run.start)
    if threading.current_thread() is threading.main_thread():
        run.handlers = {sig: signal.signal(sig, run.on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    return run


def resolve_paths(cfg: Config):
    """The run's folders, made absolute once, before anything is written: a tool or reward function that calls
    os.chdir moves no log, checkpoint or lock, and config.yaml records the folders used."""
    cfg.output_dir = os.path.abspath(cfg.output_dir)
    cfg.weight_sync_dir = os.path.abspath(cfg.weight_sync_dir)
    if cfg.model_builder or os.path.exists(cfg.model_name_or_path):  # a local folder, not a hub id
        cfg.model_name_or_path = os.path.abspath(cfg.model_name_or_path)
    if cfg.resume_from_checkpoint not in ("", "auto"):
        cfg.resume_from_checkpoint = os.path.abspath(cfg.resume_from_checkpoint)


def load_plugins(run: Run, eval_only: bool):
    cfg = run.cfg
    run.tools = [load_object(s, "tool") for s in cfg.tools]
    if cfg.agent:
        run.agent = load_object(cfg.agent, "agent")
    if cfg.agent or cfg.agent_command:
        check_agent(cfg, run.agent)
    run.turn_fns = [load_object(s, "turn reward function") for s in cfg.turn_reward_funcs]
    run.outcome_fns = [load_object(s, "outcome reward function") for s in cfg.outcome_reward_funcs]
    specs = cfg.tools + cfg.turn_reward_funcs + cfg.outcome_reward_funcs
    for i, (spec, fn) in enumerate(zip(specs, run.tools + run.turn_fns + run.outcome_fns)):
        check_plain_function(spec, fn, "tool" if i < len(run.tools) else "reward function")
    named = {}  # name -> spec: the model calls a tool by name, so a second tool of one name would shadow the first
    for spec, fn in zip(cfg.tools, run.tools):
        if fn.__name__ in named:
            raise ConfigError(f"tools '{named[fn.__name__]}' and '{spec}' are both named '{fn.__name__}'; rename one")
        named[fn.__name__] = spec
    run.turn_w = cfg.turn_reward_weights or [1.0] * len(run.turn_fns)
    run.outcome_w = cfg.outcome_reward_weights or [1.0] * len(run.outcome_fns)
    run.rows = load_rows(cfg.dataset)
    run.eval_rows = load_rows(cfg.eval_dataset)[: cfg.eval_max_examples or None] if cfg.eval_dataset else []
    # before any model work, every reward function scores two replies in no tool format: one that raises, hangs,
    # lacks a column or returns junk stops the run now
    dummy = [new_episode(r, system_prompt_for(cfg, run.tools)) for r in run.rows[:2]]
    for ep in dummy:
        ep.messages.append({"role": "assistant", "content": "."})
    record_rewards(run, dummy)
    if cfg.max_staleness and (not cfg.vllm_server_url or cfg.sync_every != 1):
        raise ConfigError(
            f"max_staleness={cfg.max_staleness} needs a vLLM server (vllm_server_url; run.sh starts one) and "
            "sync_every=1: the in-process sampler shares the weights being trained, and staleness is counted "
            "in weight versions. Set max_staleness=0, or serve the policy with vLLM."
        )
    if cfg.lora_rank and cfg.weight_sync == "nccl":
        raise ConfigError(
            "lora_rank > 0 syncs only the adapter, which the server loads from a folder: set weight_sync=filesystem"
        )
    if cfg.fsdp and not cfg.vllm_server_url:
        raise ConfigError(
            "fsdp: true needs vllm_server_url: the in-process sampler would run an FSDP all-gather per "
            "decoded token, in lockstep across ranks. Serve the policy with vLLM (run.sh does)."
        )
    if eval_only and not run.eval_rows:
        raise ConfigError(
            "eval needs eval_dataset (a .jsonl file or file.py:function), e.g. eval_dataset=tasks/triviaqa.py:eval_rows"
        )


def check_plain_function(spec: str, fn, what: str):
    lazy = any(  # returns before its body runs
        inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f) or inspect.isgeneratorfunction(f)
        for f in (fn, type(fn).__call__ if callable(fn) else None)
    )
    if lazy or not callable(fn) or (what == "tool" and not hasattr(fn, "__name__")):  # a tool is called by name
        kind = "an async def or a generator" if lazy else f"a {type(fn).__name__}"
        raise ConfigError(f"{what} '{spec}' is {kind}, not a function that returns its result; write it as a plain def")


def check_agent(cfg: Config, agent):
    """An agent harness runs its own tools, one path per episode: a function (`agent`) or a command (`agent_command`)."""
    if cfg.agent and cfg.agent_command:
        raise ConfigError("agent and agent_command are both set: a recipe names one harness; unset one")
    if cfg.tools:
        raise ConfigError(
            f"agent '{cfg.agent or cfg.agent_command}' runs its own tools: set tools: [] (it has {cfg.tools})"
        )
    if cfg.agent:
        check_plain_function(cfg.agent, agent, "agent")
        return
    if cfg.agent_processes:
        raise ConfigError(
            "agent_processes runs agent functions in worker processes; agent_command runs each episode "
            "in a process of its own already: unset agent_processes"
        )
    try:
        program = shlex.split(cfg.agent_command)[0]
    except (ValueError, IndexError) as e:
        raise ConfigError(f"agent_command: {cfg.agent_command!r} is not a command line ({e})") from None
    if shutil.which(program) is None:
        raise ConfigError(
            f"agent_command: '{program}' is not a program found on PATH; e.g. agent_command: python my_agent.py"
        )


def hold_output_dir(cfg: Config, say):
    """Rank 0: a run holds its folder with a lock on `<output_dir>.lock` (which names its PID, host and start), so a
    second run on the same folder refuses instead of mixing its files in. The OS drops the lock of a run that dies.
    A POSIX lock belongs to the process: an earlier train() in this process that failed does not block the next.
    Not filelock (which the model build uses, to wait): its error could not name the run that holds the folder."""
    path = cfg.output_dir + ".lock"  # beside the folder, which a fresh run may move aside (absolute: resolve_paths)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    f = open(path, "a+")
    f.seek(0)
    pid, host, since = (f.read().split(" ", 2) + ["", "", ""])[:3]
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise ConfigError(
            f"output_dir '{cfg.output_dir}' is in use by the run with PID {pid} on {host} (since {since}): "
            "wait for it, or choose another output_dir"
        ) from None
    if not os.path.exists(path) or not os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
        f.close()  # the run that held it removed the file after this one opened it: lock the file there now
        return hold_output_dir(cfg, say)
    if pid and pid != str(os.getpid()):
        say(f"[mt-grpo] {path} was left by a run that is gone (PID {pid}): taking it over")
    f.truncate(0)
    f.write(f"{os.getpid()} {os.uname().nodename} {time.strftime('%Y-%m-%d %H:%M:%S')}")
    f.flush()
    return f


def prepare_output_dir(cfg: Config, ckpt: str | None, eval_only: bool, say) -> str:
    """Rank 0: a fresh run moves an earlier run in output_dir aside (and returns where to), then saves the resolved
    config."""
    old = ""
    if not ckpt and not eval_only and os.path.isfile(os.path.join(cfg.output_dir, "metrics.jsonl")):
        old = f"{cfg.output_dir}.{time.strftime('%Y%m%d-%H%M%S')}"  # a fresh run never mixes with an earlier one
        os.replace(cfg.output_dir, old)
        say(
            f"[mt-grpo] {cfg.output_dir} held an earlier run: moved it to {old} "
            "(resume_from_checkpoint=auto continues a run instead)"
        )
    folder = cfg.output_dir
    if eval_only:  # the eval command's config, beside its results; a run makes eval/ when it evaluates
        folder = os.path.join(cfg.output_dir, "eval")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.yaml"), "w") as f:
        yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)  # safe_dump quotes 'off', so it reloads as a string
    return old


def build_model_if_missing(cfg: Config, say):
    """Rank 0 (or run.sh, before a server starts): build a missing model_name_or_path and print the builder's report
    (a model built by an earlier run is not reported again); a model whose builder changed since stops the run
    (`check_build`). Runs started together (a sweep, several trainers on one disk) build it once: the lock beside the
    folder makes the others wait, then use it."""
    if not cfg.model_builder:
        return
    if not os.path.exists(cfg.model_name_or_path):
        lock = filelock.FileLock(cfg.model_name_or_path.rstrip("/") + ".lock")
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            say(f"[mt-grpo] another run is building {cfg.model_name_or_path}: waiting for it ...")
            lock.acquire()
        try:
            if not os.path.exists(cfg.model_name_or_path):  # the run that held the lock built it
                build_model(cfg, say)
        finally:
            lock.release()
    check_build(cfg, say)  # one built by another run too: a sweep whose builder was edited in between


def build_model(cfg: Config, say):
    """model_builder into a temp folder, renamed to model_name_or_path when it returns: all of it or nothing, with
    what built it (`build_record`) in its build_report.json as `built_by`."""
    record = build_record(cfg)
    say(f"[mt-grpo] building {cfg.model_name_or_path} with {cfg.model_builder} ...")
    tmp = cfg.model_name_or_path.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    builder = load_object(cfg.model_builder, "model builder")
    try:
        builder(tmp, system_prompt=record["system_prompt"])
    except Exception as e:  # nothing half-built is left, and the next run builds again
        shutil.rmtree(tmp, ignore_errors=True)
        raise plugin_error(e, f"model builder '{cfg.model_builder}' failed") from None
    report_path = os.path.join(tmp, "build_report.json")
    rep = {}
    if os.path.isfile(report_path):
        with open(report_path) as f:
            rep = json.load(f)
        say(f"[mt-grpo] model built by {rep.get('builder')}: {rep.get('params')} params; {rep.get('summary', '')}")
    with open(report_path, "w") as f:
        json.dump({**rep, "built_by": record}, f, indent=2)
    os.replace(tmp, cfg.model_name_or_path)  # the folder appears with its record: a run that sees it can check it


def build_record(cfg: Config) -> dict:
    """What builds model_name_or_path: model_builder (file name and function), the SHA-256 of each source file it can
    run (its file and, transitively, the files it imports that are neither the standard library, installed packages
    nor this trainer; named relative to its folder) and the system prompt it is given."""
    builder = load_object(cfg.model_builder, "model builder")
    files = [os.path.abspath(inspect.getfile(builder))]
    folder = os.path.dirname(files[0])
    skipped = (os.path.dirname(os.__file__), os.path.abspath(__file__))
    sources = {}
    for path in files:  # grows as imports are found
        if path in sources or path.startswith(skipped) or "-packages" in path:
            continue
        with open(path, "rb") as f:
            text = f.read()
        sources[path] = hashlib.sha256(text).hexdigest()
        for node in ast.walk(ast.parse(text)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            files += [f for f in map(functools.partial(module_file, folder=folder), names) if f]
    relative = {os.path.relpath(p, folder): h for p, h in sorted(sources.items())}
    system_prompt = system_prompt_for(cfg, [load_object(s, "tool") for s in cfg.tools])
    return {"model_builder": os.path.basename(cfg.model_builder), "sources": relative, "system_prompt": system_prompt}


def module_file(name: str, folder: str) -> str | None:
    """The .py file `import name` runs from a plug-in in `folder` (its siblings first, then sys.path), found without
    importing anything nor asking sys.modules (which may hold another plug-in's sibling of that name); None if none."""
    search = [folder, *sys.path]
    spec = None
    for part in name.split("."):
        if search is None:  # `from module import name`: a name in the module, not a submodule
            return None
        spec = importlib.machinery.PathFinder.find_spec(part, search)
        if spec is None:
            return None
        search = spec.submodule_search_locations
    if spec.origin and spec.origin.endswith(".py"):
        return os.path.abspath(spec.origin)
    return None


def check_build(cfg: Config, say):
    """Stop a run whose model folder was built by another builder than the recipe's (or from other sources, or for
    another system prompt): one line that says how to rebuild. A folder without a record is said, and used."""
    report_path = os.path.join(cfg.model_name_or_path, "build_report.json")
    built_by = None
    if os.path.isfile(report_path):
        with open(report_path) as f:
            built_by = json.load(f).get("built_by")
    if built_by is None:
        say(
            f"[mt-grpo] note: {cfg.model_name_or_path} has no record of what built it (build_report.json's built_by), "
            f"so it is used as it is: if {cfg.model_builder} changed since, delete the folder to rebuild it"
        )
        return
    now = build_record(cfg)
    changed = [k for k in ("model_builder", "system_prompt") if built_by.get(k) != now[k]]
    old = built_by.get("sources", {})
    changed += [f for f in sorted(set(old) | set(now["sources"])) if old.get(f) != now["sources"].get(f)]
    if changed:
        raise ConfigError(
            f"{cfg.model_name_or_path} was built by another model_builder than {cfg.model_builder} (changed since: "
            f"{', '.join(changed)}): delete the folder to rebuild it (rm -r {cfg.model_name_or_path}), or set "
            "model_name_or_path to a new folder to keep both"
        )


def load_models(cfg: Config, src: str, device: torch.device, say=print):
    """Tokenizer, float32 policy (with LoRA: the base model and its adapters, from `src` when it is a checkpoint),
    frozen reference (beta > 0), DDP/FSDP2-wrapped policy, AdamW over what trains, and its LR schedule. A line says
    whether training packs its samples or pads them (`layout`), and why."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # no "Loading weights" bar per load, no "Writing model shards" per save
    tokenizer = pretrained(AutoTokenizer, src)
    kw = {"dtype": torch.float32}
    packed, why = layout(pretrained(AutoConfig, cfg.model_name_or_path))
    say(f"[mt-grpo] {why}")
    if packed:
        kw["attn_implementation"] = packed_attention(device)
    base = pretrained(AutoModelForCausalLM, cfg.model_name_or_path if cfg.lora_rank else src, **kw)
    model = add_lora(base, cfg, src).to(device)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # DDP/FSDP-safe
    ref_model = model if cfg.lora_rank else None  # with LoRA: the policy itself, its adapters off
    if cfg.beta > 0 and not cfg.lora_rank:
        ref_model = pretrained(AutoModelForCausalLM, cfg.model_name_or_path, **kw).to(device).eval()
        ref_model.requires_grad_(False)
    policy = wrap_model(model, cfg, device)  # what the loss runs through; `model` stays the HF (or peft) module
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas)
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    return tokenizer, model, ref_model, policy, optimizer, scheduler


def packed_attention(device: torch.device) -> str:
    """The attention that packed rows need, registered here: on a GPU `trie_flex_attention` (FlexAttention with the
    trie's block masks), elsewhere `trie_attention`, which is SDPA for every call but the packed train step's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask, sdpa_mask

    if device.type in FLEX_DEVICES:
        AttentionInterface.register("mtgrpo_flex", trie_flex_attention)
        AttentionMaskInterface.register("mtgrpo_flex", flex_attention_mask)
        return "mtgrpo_flex"
    AttentionInterface.register("mtgrpo_trie", trie_attention)
    AttentionMaskInterface.register("mtgrpo_trie", sdpa_mask)
    return "mtgrpo_trie"


def pretrained(cls, path: str, **kw):
    """`cls.from_pretrained(path)`: a folder that is not there, or a model that does not load, is one line."""
    if not os.path.isdir(path) and not re.fullmatch(r"\w[\w.-]*(/\w[\w.-]*)?", path):  # nor a hub id (org/name)
        raise ConfigError(
            f"model_name_or_path '{path}' does not exist (no such folder); set it to a model folder or a "
            "hub id (org/name), or set model_builder to a function that builds it there"
        )
    try:
        return cls.from_pretrained(path, **kw)
    except (OSError, ValueError) as e:  # transformers: OSError for a missing file or repo, ValueError for a bad one
        folder = os.path.isdir(path)
        why = " ".join(str(e).split()).rstrip(".")
        tried = "from that folder" if folder else "as a hub id (no such folder)"
        fix = "check that it holds a model saved by save_pretrained" if folder else "check the id and the network"
        raise ConfigError(f"{cls.__name__} cannot load '{path}' {tried}: {why:.400}; {fix}") from None


def add_lora(model, cfg: Config, src: str):
    """lora_rank > 0: peft adapters on the frozen base model, the checkpoint's own when `src` holds one. A new
    adapter is initialised from `seed` alone, so every rank starts from the same one (FSDP2 does not broadcast)."""
    if not cfg.lora_rank:
        return model
    from peft import LoraConfig, PeftModel, get_peft_model

    if os.path.isfile(os.path.join(src, "adapter_config.json")):
        return PeftModel.from_pretrained(model, src, is_trainable=True)
    targets = lora_targets(model, cfg)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout, target_modules=targets)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return get_peft_model(model, lora)


def lora_targets(model, cfg: Config) -> list[str]:
    """lora_target_modules, with all-linear resolved to the names of the model's linear layers but the output head.
    An MoE's router and fused experts are not linear layers, so its adapters sit on attention (and any dense MLP) in
    every family, on purpose: peft's own all-linear adapts some families' routers and experts and not others'."""
    if cfg.lora_target_modules != ["all-linear"]:
        return cfg.lora_target_modules
    head = model.get_output_embeddings()
    linear = [name for name, m in model.named_modules() if type(m) is torch.nn.Linear and m is not head]
    return sorted({name.rsplit(".", 1)[-1] for name in linear})


# === B. Logging and evaluation: metrics.jsonl, wandb, the console line, the episode dump, held-out evals =====


def evaluate(run, step: int, record: bool = False) -> dict:
    """Rollouts over the eval rows, scored by every reward function (the paper's table columns are reward functions):
    `eval_samples` episodes a row at `eval_temperature`, and above 0 one greedy episode a row beside (its means as
    eval/greedy_NAME). Rank 0 prints the table, writes eval/step-N.jsonl (and eval/step-N-greedy.jsonl; with
    `record`, as the `eval` command does, a line of eval/metrics.jsonl) and returns the means."""
    cfg = run.cfg
    t0 = time.time()
    records = eval_episodes(run, step, cfg.eval_temperature, cfg.eval_samples)
    greedy = []
    if cfg.eval_temperature > 0:
        greedy = eval_episodes(run, step, 0.0, 1)
    if run.rank != 0:
        return {}
    m = {}
    files = []
    os.makedirs(os.path.join(cfg.output_dir, "eval"), exist_ok=True)
    for prefix, recs, name in (("", records, f"step-{step}.jsonl"), ("greedy_", greedy, f"step-{step}-greedy.jsonl")):
        if not recs:
            continue
        files.append(os.path.join(cfg.output_dir, "eval", name))
        with open(files[-1], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        for fn in run.turn_fns + run.outcome_fns:
            n = reward_name(fn)
            values = [r["rewards"][n] for r in recs]
            m[f"eval/{prefix}{n}"] = float(np.mean(values))
        answered = [r["end_reason"] == "answer" for r in recs]
        m[f"eval/{prefix}answered"] = float(np.mean(answered))
    how = "greedy"
    if cfg.eval_temperature > 0:
        how = f"temperature {cfg.eval_temperature}, seeded"
    print(f"[mt-grpo] eval at step {step}: {len(records)} episodes, {how} -> {', '.join(files)}")
    print("| metric | mean |\n|---|---|")
    for k, v in m.items():
        print(f"| {k.removeprefix('eval/')} | {v:.4f} |")
    m["time/eval"] = time.time() - t0
    if record:
        path = os.path.join(cfg.output_dir, "eval", "metrics.jsonl")
        with open(path, "a") as f:
            line = {"step": step, "model": run.src, **m}
            f.write(json.dumps(line) + "\n")
    return m


def eval_episodes(run, step: int, temperature: float, samples: int) -> list[dict]:
    """`samples` episodes of each eval row (each rank takes its share of the rows), scored; on rank 0 every rank's
    records, by row and sample, else []. The sampling is seeded by the run's seed and the step: a rerun is the same."""
    cfg = run.cfg
    world = run.world
    my_rows = range(run.rank, len(run.eval_rows), world)
    mine = [(i, j) for i in my_rows for j in range(samples)]  # (row, sample) pairs
    chunk = cfg.prompts_per_step * cfg.num_generations // world
    generator = run.generator(step, draw=-1)  # a stream of its own: training draws are 0, 1, ...
    eps = []
    for k in range(0, len(mine), chunk):
        batch = mine[k : k + chunk]
        rows = [run.eval_rows[i] for i, _ in batch]
        eps += run.env.rollout(rows, run.sampler, generator, eval_temperature=temperature)
    if eps:  # bounded by reward_timeout; a signal waits for the step's end
        record_rewards(run, eps)
    kept = ("messages", "rewards", "end_reason", "tool_calls", "tool_errors")
    records = []
    for (i, j), ep in zip(mine, eps):
        fields = {k: getattr(ep, k) for k in kept}
        records.append({"step": step, "row": i, "sample": j, **fields})
    gathered = gather_to_rank0(records)  # one list per rank
    records = [r for part in gathered for r in part]
    return sorted(records, key=lambda r: (r["row"], r["sample"]))


def episode_metrics(eps: list[Episode]) -> dict:
    """This rank's rewards, advantages and rollout statistics for one step."""
    # adv/*: the mean |advantage| of the assistant turns before the first tool result (every turn without one), and after
    before = [abs(a) for ep in eps for a in ep.advantages[: ep.first_result_turn]]
    after = [abs(a) for ep in eps if ep.first_result_turn for a in ep.advantages[ep.first_result_turn :]]
    per_turn = [[ep.advantages[k] for ep in eps if k < len(ep.advantages)] for k in range(8)]  # the first 8 turns'
    moved = collections.defaultdict(bool)  # group -> whether some advantage of it is not 0 (its rewards spread)
    for ep in eps:
        moved[ep.group] |= any(ep.advantages)
    return {
        "reward/turn": float(np.mean([ep.turn_reward for ep in eps])),
        "reward/outcome": float(np.mean([ep.outcome_reward for ep in eps])),
        **{f"reward/{k}": float(np.mean([ep.rewards[k] for ep in eps])) for k in eps[0].rewards},
        "adv/before_abs": float(np.mean(before)) if before else 0.0,
        "adv/after_abs": float(np.mean(after)) if after else 0.0,
        **{f"adv/turn{k}_abs": float(np.mean(np.abs(a))) for k, a in enumerate(per_turn) if a},
        **{f"adv/turn{k}_mean": float(np.mean(a)) for k, a in enumerate(per_turn) if a},
        "adv/groups_without_spread": 1 - float(np.mean(list(moved.values()))),
        **state_match_metrics(eps),
        **rollout_metrics(eps),
    }


def state_match_metrics(eps: list[Episode]) -> dict:
    """adv/state_match_rate: the share of assistant turns sampled in exactly the state of a turn of another episode of
    their group (the baseline advantage_mode state_matched takes), overall and for each of the first 8 turn indices.
    Branching shares states by construction: not counted there."""
    if any(len(e.node) > 1 for e in eps):
        return {}
    episodes_in = collections.defaultdict(set)  # (group, state) -> the episodes that sampled a turn in it
    for i, e in enumerate(eps):
        for t in e.turns:
            episodes_in[e.group, t.state].add(i)
    matched = [[len(episodes_in[e.group, t.state]) > 1 for t in e.turns] for e in eps]
    per_turn = [[m[k] for m in matched if k < len(m)] for k in range(8)]
    every = [x for m in matched for x in m]
    return {
        "adv/state_match_rate": float(np.mean(every)) if every else 0.0,
        **{f"adv/state_match_turn{k}": float(np.mean(m)) for k, m in enumerate(per_turn) if m},
    }


def rollout_metrics(eps: list[Episode]) -> dict:
    n = len(eps)
    samples = [s for e in eps for s in e.samples]
    calls = sum(e.tool_calls for e in eps)
    named = collections.Counter(name for e in eps for name in e.tool_names)  # calls that named one of the tools
    return {
        "rollout/turns": sum(len(e.turns) for e in eps) / n,
        "rollout/tool_calls": calls / n,
        "rollout/tool_errors": sum(e.tool_errors for e in eps) / n,
        "rollout/tool_error_rate": sum(e.tool_errors for e in eps) / max(calls, 1),
        **{f"rollout/tool_share_{name}": k / named.total() for name, k in named.items()},
        "rollout/tool_output_replaced": sum(e.tool_output_replaced for e in eps),
        "rollout/truncated": sum(e.end_reason in ("truncated", "context") for e in eps) / n,
        "rollout/answered": sum(e.end_reason == "answer" for e in eps) / n,
        "rollout/empty": sum(e.end_reason == "empty" for e in eps) / n,
        "rollout/samples_per_episode": len(samples) / n,
        "rollout/forks": sum(e.forks for e in eps) / n,
        "rollout/forks_harness_edit": sum(e.forks_harness_edit for e in eps) / n,
        "rollout/forks_template": sum(e.forks - e.forks_harness_edit for e in eps) / n,
        "rollout/realigns": sum(e.realigns for e in eps) / n,
        "rollout/realigned_tokens": sum(e.realigned_tokens for e in eps) / n,
        "rollout/tokens_trained": sum(len(s.input_ids) for s in samples) / n,
        # what one sample per turn would cost: every turn re-processes its whole prompt (O(T^2))
        "rollout/tokens_per_turn_samples": sum(t.prompt_len + t.sampled_len for e in eps for t in e.turns) / n,
        "rollout/thinking_tokens_kept": sum(e.thinking_tokens_kept for e in eps) / n,
        "rollout/tokenization_mismatch": sum(e.tokenization_mismatches for e in eps),
        "rollout/sampled_tokens": sum(sum(s.loss_mask) for s in samples) / n,
        **{
            f"rollout/tool_rate_turn{i}": sum(called(e) > i for e in eps) / n
            for i in range(max(map(called, eps), default=0))
        },
        **(branch_metrics(eps) if all(e.node for e in eps) else {}),
    }


def branch_metrics(eps: list[Episode]) -> dict:
    """Branching: the paths per prompt, the branch points per prompt, and the sampled tokens a path holds as context
    because a sibling samples and trains them (the shared prefixes, each sampled once)."""
    groups = len({e.group for e in eps})
    points = {(e.group, e.node[:d]) for e in eps for d in range(1, len(e.node))}  # the nodes a path branched off at
    return {
        "rollout/paths_per_prompt": len(eps) / groups,
        "rollout/branch_points_per_prompt": len(points) / groups,
        "rollout/shared_prefix_tokens": sum(e.shared_tokens for e in eps) / len(eps),
    }


def called(ep: Episode) -> int:
    """Assistant turns that called a tool: every turn but the last, and the last too if the call limit or the context
    (no room for the next turn) ended it."""
    return len(ep.turns) - 1 + (ep.end_reason in ("max_env_steps", "context"))


class ToolCollapseAlarm:
    """Tool-use collapse (outcome-only credit can teach a policy to stop calling tools): a rate, by default the first
    turn's tool-call rate, as a mean over the last `steps` steps, below `fraction` of that mean's peak. One warning
    per collapse. A peak under MIN_PEAK is no tool use to lose (a policy that never learned to call a tool has not
    collapsed). The logger keeps a second one for tool-choice collapse, where the recipe has several tools: the rate
    is the share of the calls the most-called tool does not take, which falls as one tool takes nearly every call."""

    MIN_PEAK = 0.05

    def __init__(self, fraction: float, steps: int, what="tool-use collapse", rate="the first turn's tool-call rate"):
        self.what = what
        self.rate = rate
        self.fraction = fraction
        self.recent = collections.deque(maxlen=steps)
        self.peak = 0.0
        self.on = False

    def update(self, step: int, rate: float) -> str:
        self.recent.append(rate)
        mean = sum(self.recent) / len(self.recent)
        if len(self.recent) == self.recent.maxlen:
            self.peak = max(self.peak, mean)
        collapsed = self.peak >= self.MIN_PEAK and mean < self.fraction * self.peak
        was = self.on
        self.on = self.fraction > 0 and collapsed
        if not self.on or was:
            return ""
        return (
            f"[mt-grpo] warning: {self.what} at step {step}: {self.rate} is {mean:.2f} over the last "
            f"{len(self.recent)} steps, below {self.fraction} x its peak {self.peak:.2f}"
        )


NO_SPREAD = (
    "[mt-grpo] note: at step {step} every group's episodes got the same rewards (outcome {outcome:.3f}, turn "
    "{turn:.3f}), so every advantage is 0 and the step had no gradient: GRPO learns only from the differences "
    "within a group. If most steps look like this, the model cannot yet earn different rewards on this task. Try a "
    "model that can call the tool (see its episodes.jsonl), few-shot examples in the prompt "
    "(tasks/triviaqa_sample.py:fewshot_rows), a warm start on demonstrations (model_builder, as tasks/toy_kv.py "
    "does; docs/your-task.md), or a reward with partial credit (e.g. a turn reward for a call that runs)."
)
RECORDED = "messages end_reason tool_calls tool_errors tool_names forks forks_harness_edit realigns boundaries".split()
RECORDED += ["tokenization_mismatches"]
RECORDED += "rewards turn_rewards turn_reward outcome_reward advantages first_result_turn node turn_nodes".split()


def tool_shares(m: dict) -> dict[str, float]:
    """Each tool's share of the calls that named one of the recipe's tools, from a step's (or a window's) metrics."""
    return {k.removeprefix("rollout/tool_share_"): v for k, v in m.items() if k.startswith("rollout/tool_share_")}


def shares_text(shares: dict[str, float]) -> str:
    return ", ".join(f"{name} {v:.2f}" for name, v in sorted(shares.items(), key=lambda kv: -kv[1]))


def failing_episodes(records: list[dict], n: int = 3) -> list[str]:
    """Where to look: the n dumped episodes with the lowest outcome reward (those with tool errors first), each as its
    step and episode number in episodes.jsonl, its outcome, and its first tool error or else how it ended."""
    worst = sorted(records, key=lambda r: (r["outcome_reward"], -r["tool_errors"]))[:n]
    pointers = []
    for r in worst:
        why = f"ended: {r['end_reason']}"
        first_reply = next((i for i, m in enumerate(r["messages"]) if m["role"] == "assistant"), 0)
        results = [str(m["content"]) for m in r["messages"][first_reply:] if m["role"] != "assistant"]
        errors = [hit.group() for hit in (re.search(r"Error: [^\n]{0,100}", c) for c in results) if hit]
        if r["tool_errors"] and errors:  # run_tools writes an error result as "Error: TYPE: message"
            why = f"tool {errors[0]}"
        pointers.append(f"step {r['step']} episode {r['episode']} (outcome {r['outcome_reward']:.2f}, {why})")
    return pointers


def episode_record(step: int, i: int, group: int, ep: Episode) -> dict:
    """An episode as episodes.jsonl holds it: its fields under their own names, and its samples' exact tensors."""
    samples = [{k: getattr(s, k) for k in Sample.PER_TOKEN + ("advantages", "weights")} for s in ep.samples]
    return {"step": step, "episode": i, "group": group, **{k: getattr(ep, k) for k in RECORDED}, "samples": samples}


class MetricsLogger:
    """One dict per step: every rank's means, averaged on rank 0 (ranks hold equally many episodes;
    counts are summed), to metrics.jsonl, wandb and one console line; every `log_episodes_steps`
    steps (and at a run's first step) the step's episodes, with the exact tensors trained, to episodes.jsonl."""

    COUNTS = ("rollout/tokenization_mismatch", "rollout/rejected_nonfinite", "rollout/tool_output_replaced")

    def __init__(self, cfg: Config, rank: int, world: int, start: int, write=print):
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self.start = start
        self.write = write
        self.history = []
        self.wandb = None
        self.alarm = ToolCollapseAlarm(cfg.tool_collapse_alarm, cfg.tool_collapse_steps)
        rate = "the share of the calls that the most-called tool does not take"
        self.choice = ToolCollapseAlarm(cfg.tool_collapse_alarm, cfg.tool_collapse_steps, "tool-choice collapse", rate)
        self.failing = []  # pointers to the last dumped step's worst episodes, for the summary (`diagnose`)
        self.no_spread_said = False  # NO_SPREAD is said once a run
        if cfg.report_to == "wandb" and rank == 0:
            import wandb

            self.wandb = wandb.init(
                project=cfg.wandb_project,
                dir=cfg.output_dir,
                config=dataclasses.asdict(cfg),
                name=os.path.basename(cfg.output_dir.rstrip("/")),
                resume="allow",
            )

    def log_eval(self, step: int, evaluated: dict):
        """An evaluation without a training step (the model before training, step 0): a row of its own."""
        if self.rank == 0:
            self.write_row({"step": step, **evaluated})

    def write_row(self, m: dict):
        self.history.append(m)
        with open(os.path.join(self.cfg.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(m) + "\n")
        if self.wandb:
            self.wandb.log(m, step=m["step"])

    def log(self, step: int, m: dict, episodes: list[Episode], evaluated: dict):
        every = self.cfg.log_episodes_steps
        dump = every and (step % every == 0 or step == self.start + 1)
        records = []
        G = self.cfg.num_generations
        if dump:
            first = self.rank * (self.cfg.prompts_per_step // self.world)  # this rank's first group
            records = [episode_record(step, first * G + i, first + ep.group, ep) for i, ep in enumerate(episodes)]
        gathered = gather_to_rank0((m, records))
        if self.rank != 0:
            return
        keys = dict.fromkeys(k for g in gathered for k in g[0])  # a rank may lack a rollout/tool_rate_turnN: rate 0
        m = {"step": step, **{k: float(np.mean([g[0].get(k, 0.0) for g in gathered])) for k in keys}}
        for k in self.COUNTS:
            m[k] *= self.world
        m.update(evaluated)
        warning = self.alarm.update(step, m.get("rollout/tool_rate_turn0", 0.0))
        m["alarm/tool_collapse"] = float(self.alarm.on)
        shares = tool_shares(m)
        choice = ""
        if len(self.cfg.tools) > 1 and shares:  # a step without calls tells nothing about which tool they take
            choice = self.choice.update(step, 1 - max(shares.values()))
        m["alarm/tool_choice_collapse"] = float(self.choice.on)
        self.write_row(m)
        self.write(
            f"step {step:>4} | outcome {m['reward/outcome']:.3f} | turn {m['reward/turn']:.3f} | "
            f"loss {m.get('loss/policy', 0):+.4f} | clip {m.get('loss/clip_frac', 0):.3f} | "
            f"tool_calls {m['rollout/tool_calls']:.2f} | turns {m['rollout/turns']:.2f} | "
            f"tokens {m['rollout/tokens_trained']:.0f} | {m['time/step']:.2f}s"
        )
        if warning:
            self.write(warning)
        if choice:
            self.write(f"{choice}; the calls' shares: {shares_text(shares)}")
        if not (m["adv/before_abs"] or m["adv/after_abs"] or self.no_spread_said):
            self.write(NO_SPREAD.format(step=step, outcome=m["reward/outcome"], turn=m["reward/turn"]))
            self.no_spread_said = True
        if dump:
            records = [r for _, recs in gathered for r in recs]
            with open(os.path.join(self.cfg.output_dir, "episodes.jsonl"), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
            self.failing = failing_episodes(records)


def summarize(cfg: Config, history: list[dict], failing: list[str] = ()):
    """The run's first and last trained steps (the rewards, each reward function's, the tool calls and the share of
    them that failed), each eval metric at its first and last evaluation (step 0, the model before training, when the
    run evaluated it), and why the run may not be learning, where it is so (`diagnose`)."""
    steps = [h for h in history if h["step"] > 0]  # the trained steps: a row at step 0 is an evaluation only
    if not steps:
        print(f"[mt-grpo] nothing to do: the run is already at max_steps={cfg.max_steps}. Files: {cfg.output_dir}")
        return
    k = min(10, len(steps) // 2)  # two windows that do not overlap; a short run compares its first and last steps
    if k > 1:
        print(f"\n[mt-grpo] before/after: step {steps[0]['step']}, then {k}-step means, first vs last:")
    else:
        k = 1
        print(f"\n[mt-grpo] before/after: step {steps[0]['step']} -> step {steps[-1]['step']}:")
    first = window_means(steps[:k])
    last = window_means(steps[-k:])
    functions = [key for key in steps[-1] if key.startswith("reward/") and key not in SUMMED_REWARDS]
    keys = ["reward/outcome", "reward/turn", *functions, "rollout/tool_calls", "rollout/tool_error_rate"]
    keys = [key for key in keys if all(key in h for h in steps)]  # a run logged before a key existed has none
    width = max([22, *map(len, keys)])
    for key in keys:
        start = f"{steps[0][key]:.3f} | " if k > 1 else ""
        print(f"  {key:<{width}} {start}{first[key]:.3f} -> {last[key]:.3f}")
    for key in sorted({k for h in history for k in h if k.startswith("eval/")}):
        evals = [h for h in history if key in h]
        ends = evals[:1] + evals[1:][-1:]  # the first and the last, each once
        print(f"  {key:<22} " + " -> ".join(f"{h[key]:.3f} (step {h['step']})" for h in ends))
    print(f"  total time {sum(h['time/step'] for h in steps):.0f} s")
    reasons = diagnose(cfg, first, last, k, failing)
    if reasons:
        print(f"[mt-grpo] why it may not be learning (the last {k} steps against the first):")
        print("\n".join(f"  - {line}" for line in reasons))
    files = "config.yaml, metrics.jsonl, episodes.jsonl, checkpoint-*/"
    if len(history) > 1:  # a picture of the run (bash run.sh plot RUN_DIR ... draws several runs on one)
        try:
            plot = load_object(os.path.join(HERE, "plot.py:plot"), "plot")
            files += ", " + os.path.basename(plot([cfg.output_dir], os.path.join(cfg.output_dir, "curves.png")))
        except Exception as e:  # a picture is never worth a failed run
            print(f"[mt-grpo] warning: curves.png not drawn: {type(e).__name__}: {e}")
    report = ""  # the curves, the eval table and a few episodes token by token, on one page (show.py)
    try:
        report = load_object(os.path.join(HERE, "show.py:write_report"), "show")(cfg.output_dir)
    except Exception as e:
        print(f"[mt-grpo] warning: report.html not written: {type(e).__name__}: {e}")
    print(f"[mt-grpo] run files in {cfg.output_dir}: {files}")
    if report:
        print(f"[mt-grpo] open {report}: the curves, evaluations, and episodes shaded by advantage (run.sh show)")


SUMMED_REWARDS = ("reward/turn", "reward/outcome", "reward/outcome_before_filter")  # not a reward function's


def window_means(steps: list[dict]) -> dict[str, float]:
    """Each metric's mean over these steps (a step without it counts 0, as a tool not called that step)."""
    keys = {key for h in steps for key in h}
    return {key: float(np.mean([h.get(key, 0.0) for h in steps])) for key in keys}


def diagnose(cfg: Config, first: dict, last: dict, k: int, failing: list[str]) -> list[str]:
    """Why a run may not be learning, from its first and last k trained steps' means, each reason only where it is
    so: most groups without reward spread, tool errors, one tool taking nearly every call of several, a turn reward
    that rises while the outcome does not; and, with any of them, where to look (`failing_episodes`)."""
    lines = []
    if last.get("adv/groups_without_spread", 0.0) > 0.5:
        lines.append(
            f"{last['adv/groups_without_spread']:.0%} of the groups had no reward spread (every episode of the prompt "
            "scored the same), so they taught nothing: the model cannot yet earn different rewards on this task (a "
            "warm start, few-shot examples or partial credit: docs/your-task.md)"
        )
    if last.get("rollout/tool_error_rate", 0.0) >= 0.1:
        lines.append(
            f"tool errors: {last['rollout/tool_error_rate']:.0%} of the calls ({last['rollout/tool_calls']:.2f} "
            "calls an episode) were bad JSON, an unknown tool, or a tool that raised or returned None"
        )
    shares = tool_shares(last)
    if len(cfg.tools) > 1 and shares and max(shares.values()) >= 0.9:
        lines.append(
            f"tool-choice collapse: one of the {len(cfg.tools)} tools takes nearly every call: {shares_text(shares)}"
        )
    rise = last["reward/turn"] - first["reward/turn"]
    gain = last["reward/outcome"] - first["reward/outcome"]
    if k > 1 and rise >= 0.1 and gain < rise / 4:
        lines.append(
            f"the turn reward rose {first['reward/turn']:.3f} -> {last['reward/turn']:.3f} while the outcome did not "
            f"({first['reward/outcome']:.3f} -> {last['reward/outcome']:.3f}): what the turn reward pays for (a call "
            "that runs, a tool named) does not lead to the answer"
        )
    if lines and failing:
        lines.append(f"where to look, in {os.path.join(cfg.output_dir, 'episodes.jsonl')}: {'; '.join(failing)}")
    return lines


# === C. Samplers: token ids in, sampled token ids + logprobs + finish reason out =========
# What the loop uses of a sampler (LocalSampler, VLLMServerClient; a new one is a class and one line in setup()):
# - generate(prompts, max_tokens, temperature, top_p, stop, generator, sessions) -> one Completion per prompt, in
#   order; sessions: one key per prompt, its episode's (branches share their root's), None when there are none;
# - policy_version: None if it samples from the weights being trained (nothing to sync or check), else the version of
#   its weights, which only sync_weights(model, state_dict, version) sets: rank 0's call with the full state dict, the
#   others' with None once it returned; then probe_logprobs(ids), rank 0's: {a name per copy of the weights it samples
#   from (a server each): the logprobs of ids[1:] at temperature 1}, each checked on its own;
# - close(): at the end of a run, on every rank;
# - stats() (optional): metrics of the sampler since the last call, logged with each step's.


class LocalSampler:
    """In-process sampler on the policy itself (on-policy, no weight sync): a KV-cache decode loop whose logprobs,
    log-softmax(logits / temperature) top-p filtered, are exactly the distribution each token was drawn from."""

    policy_version = None  # the weights being trained, always current

    def __init__(self, model, tokenizer):
        self.model = model
        self.tok = tokenizer
        self.eos_ids = eos_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @torch.no_grad()
    def generate(
        self, prompts, max_tokens: list[int], temperature=1.0, top_p=1.0, stop=(), generator=None, sessions=None
    ):
        model = self.model
        dev = next(self.model.parameters()).device
        was_training = model.training
        model.eval()
        B = len(prompts)
        L = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (L - len(p)) + p for p in prompts], device=dev)
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=dev)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        out = [Completion([], [], "length") for _ in range(B)]
        done = [m < 1 for m in max_tokens]
        window = max((len(s) for s in stop), default=0) + 2  # tail of tokens that can hold a stop string
        cache = None
        new_ids = ids
        for _ in range(max(max_tokens)):
            res = model(input_ids=new_ids, attention_mask=attn, position_ids=pos, past_key_values=cache, use_cache=True)
            cache = res.past_key_values
            logits = res.logits[:, -1].float()
            if temperature > 0:
                logp = torch.log_softmax(logits / temperature, -1)
                if top_p < 1.0:
                    logp = top_p_filter(logp, top_p)
                nxt = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
            else:
                logp = torch.log_softmax(logits, -1)
                nxt = logits.argmax(-1)
            tok_lp = logp.gather(-1, nxt[:, None]).squeeze(-1).tolist()
            for b, (c, t, lp) in enumerate(zip(out, nxt.tolist(), tok_lp)):
                if done[b]:
                    continue
                c.ids.append(t)
                c.logprobs.append(lp)
                if t in self.eos_ids or (stop and any(s in self.tok.decode(c.ids[-window:]) for s in stop)):
                    c.finish_reason = "stop"
                    done[b] = True
                elif len(c.ids) >= max_tokens[b]:
                    done[b] = True
            if all(done):
                break
            new_ids = nxt[:, None]
            attn = torch.cat([attn, torch.ones_like(attn[:, :1])], -1)
            pos = pos[:, -1:] + 1
        model.train(was_training)
        return out

    def close(self):
        """Nothing to release: the model is the trainer's."""


def top_p_filter(logp: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose mass reaches top_p (always the top one); renormalise."""
    sorted_lp, idx = logp.sort(-1, descending=True)
    mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
    drop = (mass_before >= top_p).scatter(-1, idx, mass_before >= top_p)
    return torch.log_softmax(logp.masked_fill(drop, float("-inf")), -1)


class SamplerError(RuntimeError):
    """The sampler gave no valid completion within its deadline: the run stops, nothing is invented (I6)."""


class ServerDown(SamplerError):
    """A request failed and so did its server's GET /health: it goes to another server, a sync goes on without it."""


@dataclass(eq=False)
class Server:
    """One of a VLLMServerClient's servers: where it is, whether it may be sampled from, what it served lately."""

    url: str
    log: str = ""  # its log file (run.sh's MTGRPO_VLLM_LOG), whose last lines an error shows
    version: int = 0  # the policy version of the weights it holds: it is sampled from only while that is the client's
    down_since: float | None = None  # when a failed request found its GET /health failing too (time.monotonic)
    checked: float = -math.inf  # when its GET /health was last asked
    busy: int = 0  # sequences this client has in flight on it: a new session goes to the server with the fewest
    served: list = field(default_factory=lambda: [0, 0])  # requests and tokens (prompt and sampled) since stats()
    cache: list = field(default_factory=lambda: [0.0, 0.0])  # its prefix-cache queries and hits at the last stats()
    seen: bool = False  # down, it answered GET /health at this rank's last sync (see sync_weights)
    nccl: typing.Any = None  # the NCCL group with its workers, made on its first nccl sync


class VLLMServerClient:
    """Samples from separately launched vLLM servers (0.32, the version run.sh pins) over HTTP: POST /v1/completions
    with the prompt as token ids, `return_token_ids`, `logprobs: 0`, `skip_special_tokens: false`. The chat template
    is applied here, so nothing is re-tokenized (I1). Every prompt of a batch is in flight at once; identical prompts
    (a group's first turn) are one request with `n`. Transient failures are retried with backoff until
    `request_deadline`. A reply without token ids or logprobs, or with ids outside the vocabulary, is an error: vLLM
    ignores misspelt fields (I6).
    Several servers serve data-parallel: an episode's session stays on one (its prefix cache holds the history), a new
    one goes to the least busy; one found down is left (`check_alive`) until a weight sync takes it back (`route`)."""

    def __init__(self, cfg: Config, vocab_size: int, stop_token_ids=(), stop_event=None, say=print):
        self.cfg = cfg
        self.say = say
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        logs = [os.path.abspath(p) for p in os.environ.get("MTGRPO_VLLM_LOG", "").split(",") if p]  # one per server
        logs += [""] * len(cfg.vllm_server_url)  # none for servers run.sh did not start
        self.servers = [Server(url.rstrip("/"), log) for url, log in zip(cfg.vllm_server_url, logs)]
        self.url = ", ".join(s.url for s in self.servers)  # for messages
        self.local = threading.local()  # one requests.Session per worker thread
        token = os.environ.get("MTGRPO_VLLM_TOKEN", "")  # asked of every request by vllm_token.py, in the server
        self.auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.pool = DaemonPool(cfg.max_concurrent_requests)  # daemons: an error never waits on requests still retrying
        self.admin = DaemonPool(len(self.servers))  # a sync's requests, one per server at once, never behind rollouts
        self.sessions: collections.OrderedDict = collections.OrderedDict()  # session -> its server, oldest use first
        self.lock = threading.Lock()
        self.lost = 0  # servers found down since stats()
        self.none_since = None
        self.turn = int(os.environ.get("RANK", 0))  # ties go round the servers, each rank from its own
        self.policy_version = 0  # with run_tag, the cache_salt: no KV of other weights or runs is reused
        self.run_tag = hashlib.sha1(os.path.abspath(cfg.output_dir).encode()).hexdigest()[:8]
        # one folder per run, so runs that share weight_sync_dir never clean up each other
        self.sync_dir = os.path.join(cfg.weight_sync_dir, os.path.basename(os.path.abspath(cfg.output_dir)))
        self.adapters = []  # LoRA: (name, folder) of the adapters loaded on the servers, oldest first
        self.stop_event = stop_event or threading.Event()  # set on SIGTERM/Ctrl-C: requests stop retrying
        deadline = min(60.0, cfg.request_deadline)
        info = [self.request("GET", "/v1/models", deadline=deadline, server=s)["data"][0] for s in self.servers]
        if len({i["id"] for i in info}) > 1:  # requests name one model
            raise SamplerError(f"the vLLM servers {self.url} serve different models: {[i['id'] for i in info]}")
        self.model = info[0]["id"]
        self.max_model_len = min(int(i["max_model_len"]) for i in info)
        say(f"[mt-grpo] sampling from {self.url} ({self.model}, max_model_len {self.max_model_len})")
        if self.max_model_len < cfg.max_seq_len:
            say(f"[mt-grpo] the server's max_model_len is below max_seq_len {cfg.max_seq_len}: it bounds episodes")
        if not cfg.sync_check:
            say(
                "[mt-grpo] sync_check: false: no weight sync is checked, so a reload that failed, took in part or did "
                "nothing would go on training off-policy without a word"
            )

    # A loop, not tenacity: measured, its Retrying with the same hooks (a signal, the health check, the deadline's
    # message) as closures took 32 more code tokens and one more dependency, and kept the same behaviour.
    def request(self, method, path, deadline=None, retry_5xx=True, plain=False, *, server: Server, **kw) -> dict:
        deadline = deadline or self.cfg.request_deadline
        end = time.monotonic() + deadline
        delay = 0.5
        for attempt in itertools.count(1):
            try:
                if not hasattr(self.local, "session"):
                    self.local.session = requests.Session()
                    self.local.session.trust_env = False  # no proxy or .netrc lookups per request: the server is ours
                    self.local.session.headers.update(self.auth)
                timeout = max(0.1, min(self.cfg.request_timeout, end - time.monotonic()))
                r = self.local.session.request(method, server.url + path, timeout=timeout, **kw)
                if r.status_code >= 500 and retry_5xx:
                    raise requests.HTTPError(f"HTTP {r.status_code}: {r.text[:200]}")  # retried below
                if r.status_code >= 400:  # our request is wrong (or the server's worker failed): retrying cannot help
                    raise SamplerError(f"{method} {server.url}{path} was refused: HTTP {r.status_code}: {r.text[:500]}")
                return {"text": r.text} if plain else r.json()  # plain: the LoRA routes answer in plain text
            except requests.RequestException as e:  # refused, dropped, timed out, 5xx, truncated JSON: retried
                last = f"{type(e).__name__}: {str(e)[:300]}"
            if self.stop_event.is_set():
                raise SamplerError(
                    f"stopped (SIGTERM or Ctrl-C) while retrying {method} {path} at {server.url} (last: "
                    f"{last}); saved checkpoints are unaffected"
                )
            self.check_alive(server, f"{method} {path} failed ({last})")
            if time.monotonic() + delay > end:
                raise SamplerError(
                    f"the vLLM server at {server.url} gave no usable answer to {method} {path} within "
                    f"{deadline:.0f}s ({attempt} attempts; last: {last}). Is `vllm serve` "
                    f"running there and healthy (GET {server.url}/health)?"
                )
            self.stop_event.wait(delay)
            delay = min(2 * delay, 10.0)

    def healthy(self, s: Server) -> bool:
        """GET /health, at most every 2 s per server (else the last answer): 200, or too slow to tell (busy, not dead)."""
        with self.lock:
            if time.monotonic() - s.checked < 2.0:
                return s.down_since is None
            s.checked = time.monotonic()
        try:
            return requests.get(s.url + "/health", headers=self.auth, timeout=2.0).status_code == 200
        except requests.RequestException as e:
            return isinstance(e, requests.ReadTimeout)

    def check_alive(self, s: Server, failed: str):
        """After a failed attempt: `s` is down from now on (ServerDown) if its GET /health fails too, else retried."""
        if s.down_since is None and self.healthy(s):
            return
        with self.lock:
            first = s.down_since is None
            s.down_since = s.down_since or time.monotonic()
            s.nccl = None
            self.lost += first
        if first:
            self.say(
                f"[mt-grpo] the vLLM server at {s.url} is down ({failed}; GET /health too): its sessions go on "
                "on the others; a weight sync takes it back once it answers again"
            )
        raise ServerDown(f"the vLLM server at {s.url} is down: {failed} and so did GET /health")

    def route(self, sessions, n: int) -> Server:
        """The server for a request of n sequences, reserved on it: its sessions' (an episode stays where its history is
        cached), else the usable one with the fewest in flight (ties in turn), which they keep. With none usable, wait
        for one that answers again and missed no sync; after server_dead_timeout the run stops."""
        while True:
            with self.lock:
                usable = [s for s in self.servers if s.down_since is None and s.version == self.policy_version]
                if usable:
                    s = next((self.sessions[k] for k in sessions if self.sessions.get(k) in usable), None)
                    if s is None:
                        s = min(usable, key=lambda x: (x.busy, (self.servers.index(x) - self.turn) % len(self.servers)))
                        self.turn = self.servers.index(s) + 1
                    for k in sessions:
                        self.sessions[k] = s
                        self.sessions.move_to_end(k)
                    while len(self.sessions) > 65536:  # bounded: more than the episodes of any rollouts in flight
                        self.sessions.popitem(last=False)
                    s.busy += n
                    self.none_since = None
                    return s
                self.none_since = self.none_since or time.monotonic()
                waited = time.monotonic() - self.none_since
            if waited >= self.cfg.server_dead_timeout or self.stop_event.wait(1.0):
                why = "stopped by SIGTERM or Ctrl-C" if self.stop_event.is_set() else "server_dead_timeout"
                raise self.none_left(f"to sample from after {waited:.0f}s ({why})")
            for s in self.servers:  # back after a hiccup with the weights it had: usable again
                if s.down_since is not None and s.version == self.policy_version and self.healthy(s):
                    s.down_since = None

    def none_left(self, doing: str) -> SamplerError:
        """Every server is down: the error that stops the run, with each one's log tail (run.sh's MTGRPO_VLLM_LOG)."""
        tails = ""
        for s in self.servers:
            with contextlib.suppress(OSError), open(s.log, errors="replace") as f:
                tails += f"\nLast lines of the log of {s.url} ({s.log}):\n" + "".join(f.readlines()[-20:])
        return SamplerError(
            f"no vLLM server is left {doing}: {self.url} failed GET /health (their processes are gone or their engines "
            f"died) or missed a weight sync while down; saved checkpoints are unaffected.{tails}"
        )

    def generate(
        self, prompts, max_tokens: list[int], temperature=1.0, top_p=1.0, stop=(), generator=None, sessions=None
    ):
        groups: dict[tuple, list[int]] = {}
        for i, (p, m) in enumerate(zip(prompts, max_tokens)):
            groups.setdefault((tuple(p), m), []).append(i)
        futures = {}
        for (p, m), idx in groups.items():
            kw = dict(prompt=list(p), n=len(idx), max_tokens=m, sessions=[sessions[i] for i in idx] if sessions else ())
            futures[self.pool.submit(self.complete, temperature=temperature, top_p=top_p, stop=stop, **kw)] = idx
        out = {i: c for fut, idx in futures.items() for i, c in zip(idx, fut.result())}
        return [out[i] for i in range(len(prompts))]

    def complete(
        self, prompt: list[int], n: int, max_tokens: int, temperature: float, top_p: float, stop, sessions=()
    ) -> list[Completion]:
        budget = min(max_tokens, self.max_model_len - len(prompt))
        if budget < 1:  # no room left in the server's context: the episode ends truncated, no request sent
            return [Completion([], [], "length") for _ in range(n)]
        # Every sampling knob is explicit: vLLM fills omitted ones from the model's generation_config.json
        # (Qwen3: top_k 20), which would sample from a distribution the trainer does not score.
        if temperature == 0 and n > 1:  # vLLM refuses n > 1 when greedy; greedy copies are identical anyway
            return self.complete(prompt, 1, max_tokens, temperature, top_p, stop, sessions) * n
        knobs = {"temperature": temperature, "top_p": top_p, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        ids_back = {"logprobs": 0, "return_token_ids": True, "skip_special_tokens": False}  # sampled ids verbatim (I1)
        body = {"prompt": prompt, "n": n, "max_tokens": budget, **knobs, **ids_back}
        body.update(stop=list(stop), stop_token_ids=self.stop_token_ids)
        end = time.monotonic() + self.cfg.request_deadline
        while True:
            version = self.policy_version  # a retry after a sync samples from the new weights (LoRA: adapter)
            body["cache_salt"] = f"{self.run_tag}-v{version}"
            body["model"] = self.model_for(version)
            s = self.route(sessions, n)
            try:
                reply = self.request(
                    "POST", "/v1/completions", deadline=max(1.0, end - time.monotonic()), server=s, json=body
                )
            except ServerDown:  # its sessions go on on another server
                continue
            finally:
                with self.lock:
                    s.busy -= n
            replies = sorted(reply.get("choices") or [], key=lambda c: c.get("index", 0))
            if not any(c.get("finish_reason") in ("abort", "error") for c in replies) or time.monotonic() > end:
                break  # aborted (the server was paused or failed mid-request): ask again
        with self.lock:
            s.served = [s.served[0] + 1, s.served[1] + (reply.get("usage") or {}).get("total_tokens", 0)]
        if len(replies) != n:
            raise SamplerError(f"{s.url}/v1/completions returned {len(replies)} choices for n={n}")
        return [self.completion(c, version, s.url) for c in replies]

    def stats(self) -> dict:
        """Since the last call: each server's share of the requests and tokens (prompt and sampled) served, how even (the
        mean server's tokens over the busiest's), the servers found down, and the prefix-cache hit rate from their own
        counters (GET /metrics, prompt tokens): how much of what was sent again (a turn's history, a sibling's shared
        prefix) they did not recompute."""
        with self.lock:
            served = np.array([s.served for s in self.servers], dtype=float)
            lost = self.lost
            self.lost = 0
            for s in self.servers:
                s.served = [0, 0]
        m = {"rollout/servers_lost": lost, "rollout/servers_up": sum(s.down_since is None for s in self.servers)}
        for i, (requests_, tokens) in enumerate(served / np.maximum(served.sum(0), 1)):
            m[f"rollout/server{i}_request_share"] = requests_
            m[f"rollout/server{i}_token_share"] = tokens
        m["rollout/server_balance"] = served[:, 1].mean() / served[:, 1].max() if served[:, 1].max() else 1.0
        cache = np.zeros(2)
        for s in (s for s in self.servers if s.down_since is None):
            with contextlib.suppress(SamplerError):  # a server without /metrics, or down: nothing to add
                text = self.request("GET", "/metrics", deadline=10.0, plain=True, server=s)["text"].splitlines()
                now = [
                    sum(float(x.split()[-1]) for x in text if x.startswith(f"vllm:prefix_cache_{k}_total"))
                    for k in ("queries", "hits")
                ]
                cache += np.subtract(now, s.cache if now[0] >= s.cache[0] else 0)  # a restarted server counts from 0
                s.cache = now
        if cache[0]:
            m["rollout/prefix_cache_hit_rate"] = cache[1] / cache[0]
        return m

    def probe_logprobs(self, ids: list[int]) -> dict[str, list[float]]:
        """Each server's logprob of every token of `ids` given those before it (temperature 1), by URL: the weight-sync
        check. Salted by version: with max_staleness >= 1 a sync keeps the prefix cache, whose KV is the old weights'."""
        body = {"model": self.model_for(self.policy_version), "prompt": ids, "max_tokens": 1, "temperature": 1.0}
        body.update(prompt_logprobs=0, cache_salt=f"{self.run_tag}-probe-v{self.policy_version}")
        servers = [s for s in self.servers if s.down_since is None and s.version == self.policy_version]
        out = {}
        for s, reply in zip(servers, self.each(servers, "/v1/completions", json=body)):
            lps = reply["choices"][0].get("prompt_logprobs")
            if not isinstance(lps, list) or len(lps) != len(ids):
                raise SamplerError(
                    f"{s.url}/v1/completions returned no prompt_logprobs for the weight-sync probe; a server that "
                    "cannot return them needs sync_check: false (then no sync is checked)"
                )
            out[s.url] = [float(d[str(t)]["logprob"]) for d, t in zip(lps[1:], ids[1:])]
        return out

    def completion(self, c: dict, version: int, url: str) -> Completion:
        ids = c.get("token_ids")
        lps = (c.get("logprobs") or {}).get("token_logprobs")
        where = f"{url}/v1/completions"
        if not isinstance(ids, list) or not isinstance(lps, list):
            raise SamplerError(
                f"{where} returned no {'token_ids' if not isinstance(ids, list) else 'logprobs'}; "
                "mt-grpo needs vLLM >= 0.10.2, which honours return_token_ids and logprobs=0"
            )
        if len(ids) != len(lps):
            raise SamplerError(f"{where} returned {len(ids)} token ids but {len(lps)} logprobs")
        if any(not isinstance(t, int) or not 0 <= t < self.vocab_size for t in ids):
            raise SamplerError(
                f"{where} returned token ids outside the vocabulary [0, {self.vocab_size}): is it "
                "serving the model this run trains?"
            )
        if c.get("finish_reason") not in ("stop", "length", "repetition"):
            raise SamplerError(f"{where} finished a completion with {c.get('finish_reason')!r}")
        return Completion(ids, [float(x) for x in lps], "stop" if c["finish_reason"] == "stop" else "length", version)

    def each(self, servers: list[Server], path: str, **kw) -> list[dict]:
        """POST `path` to every server of `servers` at once; one found down meanwhile leaves the list, the rest go on."""
        futures = [(s, self.admin.submit(self.request, method="POST", path=path, server=s, **kw)) for s in servers]
        replies = []
        for s, fut in futures:
            try:
                replies.append(fut.result())
            except ServerDown:
                servers.remove(s)
        if not servers:
            raise self.none_left(f"to answer POST {path}")
        return replies

    def sync_weights(self, model, state_dict: dict | None, version: int):
        """Make every server that answers sample from `state_dict` (rank 0; the servers at once, and a server found
        down before taken back), then name `version` in requests (every rank)."""
        if state_dict is None:  # the ranks other than 0, once rank 0's call returned: the servers up here hold
            # `version`; one down here is taken back only if it answered at this rank's last sync too (rank 0 synced it)
            for s in self.servers:
                back = s.seen
                s.seen = s.down_since is not None and self.healthy(s)
                if s.down_since is None or back and s.seen:
                    s.version = version
                    s.down_since = None
                    s.seen = False
            self.policy_version = version
            return
        servers = [s for s in self.servers if s.down_since is None or self.healthy(s)]
        if self.cfg.weight_sync == "nccl":
            return self.sync_weights_nccl(servers, state_dict, version)
        path = os.path.join(self.sync_dir, f"step_{version}")  # a fresh folder every time (vLLM #32718)
        shutil.rmtree(path, ignore_errors=True)
        if self.cfg.lora_rank:
            model.save_pretrained(path, state_dict=state_dict)  # peft writes the adapter alone
            return self.load_adapter(servers, path, version)
        bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state_dict.items()}
        model.save_pretrained(path, safe_serialization=True, state_dict=bf16)  # makes sync_dir too
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}, "timeout": self.cfg.request_timeout}
        with self.weight_update(servers, version):
            try:
                self.each(servers, "/collective_rpc", retry_5xx=False, json=rpc)
            except SamplerError as e:  # vLLM 0.32: a failed reload leaves layers half-loaded; the next forward kills it
                raise SamplerError(
                    f"could not reload the weights of step {version} from {path}: {e}. Restart that server (its model "
                    "is left half-loaded), then resume_from_checkpoint=auto"
                ) from None
        self.cleanup(keep_folders=[os.path.basename(path)])

    def model_for(self, version: int) -> str:
        """What requests name: with LoRA the adapter of `version` (every rank knows its name), else the served model."""
        return f"mt-grpo-{self.run_tag}-v{version}" if self.cfg.lora_rank else self.model

    def load_adapter(self, servers: list[Server], path: str, version: int):
        """LoRA: the servers add the new adapter beside the base model under a new name, which requests name from now
        on; a request already sent keeps its own. The last max_staleness + 2 adapters stay loaded, older ones go."""
        name = self.model_for(version)
        load = {"lora_name": name, "lora_path": path, "load_inplace": True}  # in place: a retry or a resume is harmless
        try:
            with self.weight_update(servers, version, pause=False):  # beside the old adapters: nothing to pause
                self.each(servers, "/v1/load_lora_adapter", retry_5xx=False, plain=True, json=load)
        except SamplerError as e:
            raise SamplerError(
                f"{e}\nlora_rank={self.cfg.lora_rank} needs a server started with --enable-lora, --max-lora-"
                "rank >= lora_rank and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (run.sh adds them)"
            ) from None
        self.adapters.append((name, path))
        while len(self.adapters) > self.cfg.max_staleness + 2:
            self.unload(self.adapters.pop(0)[0])
        self.cleanup(keep_folders=[os.path.basename(p) for _, p in self.adapters])

    def unload(self, name: str):
        """Unload a LoRA adapter from every server that is up (one taken back since it was loaded never had it)."""
        up = [s for s in self.servers if s.down_since is None]
        with contextlib.suppress(SamplerError):  # best effort: each server gets its request, whatever another answers
            self.each(up, "/v1/unload_lora_adapter", deadline=30.0, plain=True, json={"lora_name": name})

    @contextlib.contextmanager
    def weight_update(self, servers: list[Server], version: int, pause: bool = True):
        """Around every sync of `servers` (one found down meanwhile leaves the list), the one place versions change. With
        `pause` (a reload) nothing is generated while weights change, no old KV is reused (neither path resets the prefix
        cache itself), the servers always resume. On-policy, requests in flight are aborted (and sent again); with
        max_staleness >= 1 they are frozen (mode=keep) and go on under the new weights after the resume: partial
        rollouts, their tokens' logprobs those of the weights that sampled them. The new cache_salt, set before the
        resume, keeps new requests off the old prefix cache."""
        partial = self.cfg.max_staleness > 0  # partial rollouts: requests in flight are frozen, not aborted
        mode = {"mode": "keep" if partial else "abort", "clear_cache": str(not partial).lower()}
        if pause:
            self.each(servers, "/pause", params=mode)
        try:
            yield
            if pause and not partial:
                self.each(servers, "/reset_prefix_cache")
            for s in servers:  # synced: sampled from again (one taken back too)
                s.version = version
                s.down_since = None
            self.policy_version = version
        finally:
            if pause:
                self.each(servers, "/resume")

    def sync_weights_nccl(self, servers: list[Server], state_dict: dict, version: int):
        """vLLM's native weight transfer: rank 0 joins each server's workers in an NCCL group once, then broadcasts packed
        bf16 tensors to one server after another while its /update_weights receives them. Needs servers run with
        --weight-transfer-config '{"backend":"nccl"}', vllm on the trainer, MTGRPO_NCCL_ADDR: this host as they see it."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        dev = "cuda" if torch.cuda.is_available() else "cpu"  # the current CUDA device
        tensors = {k: v.to(dev, torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in state_dict.items()}
        for s in (s for s in servers if s.nccl is None):
            size = self.request("GET", "/get_world_size", server=s)["world_size"]
            addr = os.environ.get("MTGRPO_NCCL_ADDR", "127.0.0.1")
            info = {"master_address": addr, "master_port": free_port(), "world_size": 1 + size}
            init = {"init_info": {**info, "rank_offset": 1, "packed": True}}
            joined = self.admin.submit(
                self.request, method="POST", path="/init_weight_transfer_engine", server=s, json=init
            )
            s.nccl = trainer_init(info)  # blocks until the server's workers join, as /init_... does
            joined.result()
        names, dtypes, shapes = zip(*((k, str(t.dtype)[6:], list(t.shape)) for k, t in tensors.items()))  # bfloat16
        meta = {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}}
        with self.weight_update(servers, version):
            for s in servers:
                self.request("POST", "/start_weight_update", server=s)
                got = self.admin.submit(self.request, method="POST", path="/update_weights", server=s, json=meta)
                packed_nccl_broadcast_producer(iter(tensors.items()), s.nccl, 0, lambda kv: kv[1])
                got.result()
                self.request("POST", "/finish_weight_update", server=s, json={"weight_version": str(version)})

    def cleanup(self, keep_folders=()):
        """Remove the synced folders but `keep_folders`; with none kept (the run's end) unload its adapters too."""
        for old in set(os.listdir(self.sync_dir) if os.path.isdir(self.sync_dir) else ()) - set(keep_folders):
            shutil.rmtree(os.path.join(self.sync_dir, old), ignore_errors=True)
        while not keep_folders and self.adapters:
            self.unload(self.adapters.pop()[0])

    close = cleanup  # at the end of a run: no folder kept, this run's adapters unloaded


class RolloutProducer:
    """max_staleness = k >= 1: a thread runs `collect` for the coming steps while the trainer updates. It may start
    step s once the server holds the weights of step s - k (a permit per sync), so it runs at most k steps ahead and
    no token it samples is more than k versions older than the update; `take` hands the steps back in order. At k = 0
    there is no thread: `take` runs `collect` then and there."""

    def __init__(self, run, start: int):
        self.run = run
        self.k = run.cfg.max_staleness
        self.closed = False
        self.permits = threading.Semaphore(self.k + 1)
        self.ready = queue.Queue()
        if self.k:
            threading.Thread(target=self.work, args=(start,), daemon=True, name="mt-grpo-rollouts").start()

    def work(self, start: int):
        for step in range(start, self.run.cfg.max_steps):
            self.permits.acquire()
            if self.closed:
                return
            try:
                self.ready.put(collect(self.run, step))
            except BaseException as e:  # handed to the trainer, which raises it
                return self.ready.put(e)

    def take(self, step: int) -> tuple[list[Episode], dict]:
        t0 = time.time()
        out = self.ready.get() if self.k else collect(self.run, step)
        if isinstance(out, BaseException):
            raise out
        episodes, m = out
        m["time/wait_rollout"] = time.time() - t0
        if self.k:  # how many versions before the update each trained token was sampled (the permits keep it <= k)
            ages = [step - v for ep in episodes for s in ep.samples for v, on in zip(s.versions, s.loss_mask) if on]
            m["rollout/staleness_mean"] = float(np.mean(ages)) if ages else 0.0
            m["rollout/staleness_max"] = max(ages, default=0)
        return episodes, m

    def advance(self):
        """The server now samples from the next weights: one more step's rollouts may start."""
        self.permits.release()

    def close(self):
        self.closed = True
        self.permits.release()


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id if model.generation_config else None
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else []) | {tokenizer.eos_token_id}


# === D. Distributed and batched: torchrun ranks, collectives, DDP/FSDP2, state dicts, micro-batches, LR schedule ===


def init_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; alone, FSDP2 still gets the 1-rank group it needs."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        if not cfg.fsdp:
            return 0, 1, torch.device("cuda" if cuda else "cpu")
        port = str(free_port())
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cfg.prompts_per_step % world:
        raise ConfigError(
            f"prompts_per_step={cfg.prompts_per_step} must be a multiple of the {world} training ranks "
            "(each rank gets whole GRPO groups)"
        )
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=cfg.distributed_timeout))
    return rank, world, torch.device(f"cuda:{local}" if cuda else "cpu")


def exit_now(code: int):
    """Exit without waiting on collectives or worker threads another rank might never finish."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code) if dist.is_initialized() or "RANK" in os.environ else sys.exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce(*xs: float, op: str = "sum") -> list[float]:
    """Each number summed over ranks, or with op="max" its largest value on any rank (identity in one process)."""
    if not dist.is_initialized():
        return list(xs)
    t = torch.tensor(xs, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op.upper()))
    return t.tolist()


def gather_to_rank0(obj) -> list:
    """Every rank's `obj`, as a list on rank 0 ([obj] in one process)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out or []


@contextlib.contextmanager
def gradient_sync(model, sync: bool):
    """Reduce gradients over ranks only when `sync` (after the last micro-batch): FSDP2 and DDP each have a switch."""
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)  # FSDP2
    with model.no_sync() if hasattr(model, "no_sync") and not sync else contextlib.nullcontext():  # DDP
        yield


def wrap_model(model, cfg: Config, device: torch.device):
    """DDP replicates the model on every rank; FSDP2 shards each decoder layer and the rest."""
    if cfg.fsdp:
        from torch.distributed.fsdp import fully_shard

        for m in model.modules():
            if type(m).__name__ in (model._no_split_modules or []):
                fully_shard(m)
        return fully_shard(model)
    if dist.is_initialized():
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def full_state(model, optimizer=None, fsdp: bool = False):
    """Full (unsharded, CPU) model and optimizer state dicts, for rank 0. Call on every rank: under FSDP
    it is a collective; replicated (DDP) ranks other than 0 get (None, None) without copying anything.
    With LoRA only the adapters' tensors: the frozen base is never copied, synced or saved."""
    frozen = any(not p.requires_grad for p in model.parameters())
    trains = {n for n, p in model.named_parameters() if p.requires_grad}  # a tied head is the (frozen) embedding
    if not fsdp:
        if dist.is_initialized() and dist.get_rank() != 0:
            return None, None
        sd = {k: v.detach().cpu() for k, v in model.state_dict().items() if not frozen or k in trains}
        return sd, optimizer.state_dict() if optimizer else None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen)
    sd = {k: v for k, v in get_model_state_dict(model, options=opts).items() if not frozen or k in trains}
    return sd, get_optimizer_state_dict(model, optimizer, options=opts) if optimizer else None


# the families whose packed rows tests/test_models.py checks exact; any other model trains in padded rows
PACKED_MODEL_TYPES = (
    "llama qwen2 qwen3 qwen3_moe mistral mixtral phi3 olmo olmo2 olmo3 olmoe granite granitemoe smollm3 glm glm4 gemma "
    "gemma3_text cohere cohere2 starcoder2 stablelm helium arcee apertus ernie4_5 exaone4 hunyuan_v1_dense ministral "
    "gpt_oss"
).split()
FLEX_DEVICES = {"cuda"}  # device types whose packed rows use FlexAttention's block mask; the CPU's has no backward


def pack_rows(samples: list[Sample], capacity: int) -> list[dict]:
    """Packed rows of at most `capacity` tokens (a longer sample gets a row of its own), each a prefix trie laid out
    depth first: samples sorted by token ids, each adds only its tokens after its common prefix with the one before
    it in the row, so a prefix that samples share (a group's prompt, a branch's context) appears once. Merging is by
    exact token ids: a shared token has the same ancestors in every sample, so it computes the same. A row's
    `members` are (sample index, the row position of each of its tokens, how many were in the row before it);
    `pos` is each token's depth on its path."""
    rows: list[dict] = []
    held: list[int] = []  # the token ids of the open row's last sample
    for i in sorted(range(len(samples)), key=lambda i: samples[i].input_ids):
        ids = samples[i].input_ids
        shared = len(os.path.commonprefix([held, ids]))
        if not rows or len(rows[-1]["ids"]) + len(ids) - shared > capacity:
            rows.append({"ids": [], "pos": [], "members": []})
            shared = 0
        row = rows[-1]
        start = len(row["ids"])
        prefix = row["members"][-1][1][:shared] if shared else np.zeros(0, dtype=np.int64)
        row["members"].append((i, np.concatenate([prefix, np.arange(start, start + len(ids) - shared)]), shared))
        row["ids"] += ids[shared:]
        row["pos"] += range(shared, len(ids))
        held = ids
    return rows


def layout(config) -> tuple[bool, str]:
    """Whether a model trains on packed rows, and the line that says why. Packing hands the model a custom mask and
    position ids, which only a family checked exact takes as given (its attention may need what the trie's does not
    give: soft-capping, sinks); any other causal LM trains in padded rows, one sample a row, through its own mask."""
    kind = config.model_type
    if kind not in PACKED_MODEL_TYPES:
        return False, f"padded rows: {kind} is not a family checked exact in packed rows (see PACKED_MODEL_TYPES)"
    if getattr(config, "output_router_logits", False):
        return False, f"padded rows: {kind} computes its router's aux loss from a padding mask, which packed rows lack"
    return True, f"packed rows: {kind} is checked exact"


def padded_rows(samples: list[Sample]) -> list[dict]:
    """One row per sample, nothing shared: `pack_rows`'s layout for a model that does not pack."""
    rows = []
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        rows.append({"ids": s.input_ids, "pos": list(range(n)), "members": [(i, np.arange(n), 0)]})
    return rows


def make_microbatches(rows: list[dict], budget: int) -> list[list[dict]]:
    """Rows longest first, as many to a micro-batch as fit `budget` tokens (rows x the longest); a longer row alone."""
    mbs: list[list[dict]] = []
    for row in sorted(rows, key=lambda row: -len(row["ids"])):
        if mbs and (len(mbs[-1]) + 1) * len(mbs[-1][0]["ids"]) <= budget:
            mbs[-1].append(row)
        else:
            mbs.append([row])
    return mbs


def attention_mask(end: torch.Tensor, depth: torch.Tensor, segments: list[tuple]):
    """Which keys each query sees in depth-first trie rows: key k's subtree is the span k..end[k], so query q sees k
    iff k <= q <= end[k], its ancestors and itself. A layer with a sliding window W (the `sliding_window` its attention
    passes) sees the ancestors fewer than W deep above the query, depth[q] - depth[k] < W, as transformers' own window
    (kv > q - W) on one sample's row. On a GPU, FlexAttention's block mask of that (it skips the blocks that see
    nothing), which carries the trie for `trie_flex_attention` to make a window's mask; elsewhere `trie_attention`
    runs each sample's span against its path (`segments`), and the mask is a placeholder of the 4D shape that
    transformers passes through to it as given."""
    R, L = end.shape
    if end.device.type in FLEX_DEVICES:
        mask = trie_block_mask(end, depth, None)
        mask.trie_rows = {"end": end, "depth": depth, "windowed": {}}
        return mask
    mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=end.device).expand(R, 1, L, L)
    mask.trie_segments = segments
    return mask


def trie_block_mask(end: torch.Tensor, depth: torch.Tensor, window: int | None):
    """FlexAttention's block mask of the trie rows (see `attention_mask`), within `window` when it is not None."""
    from torch.nn.attention.flex_attention import create_block_mask

    R, L = end.shape

    def sees(b, h, q, k):
        ancestor = (k <= q) & (q <= end[b, k])
        if window is None:
            return ancestor
        return ancestor & (depth[b, q] - depth[b, k] < window)

    return create_block_mask(sees, R, None, L, L, device=end.device)


def trie_flex_attention(module, query, key, value, attention_mask, **kwargs):
    """FlexAttention (a GPU's packed attention): a layer with a sliding window takes the trie's block mask within its
    window, made once a micro-batch; any other call (a full layer, the sampler's mask) is transformers' own."""
    from transformers.integrations.flex_attention import flex_attention_forward

    window = kwargs.get("sliding_window")
    rows = getattr(attention_mask, "trie_rows", None)
    if window and rows is not None:
        if window not in rows["windowed"]:
            rows["windowed"][window] = trie_block_mask(rows["end"], rows["depth"], window)
        attention_mask = rows["windowed"][window]
    return flex_attention_forward(module, query, key, value, attention_mask, **kwargs)


def trie_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention over packed trie rows without a dense mask: each sample's new tokens (a span of its row, the last of
    its path) attend to the keys of its path, so a token sees exactly its ancestors (within the layer's sliding
    window, if it has one: see `attention_mask`; keys older than the window are not read) and no pair that a dense
    [L, L] mask would hide is computed. Any other call (the sampler's, a plain mask) is SDPA's, or with attention
    sinks `attend`'s."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    segments = getattr(attention_mask, "trie_segments", None)
    sinks = kwargs.get("s_aux")  # gpt_oss's attention sinks, which transformers' SDPA does not compute
    if segments is None and sinks is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    if segments is None:  # a plain call with sinks: sdpa_mask's mask, or None where the call is causal
        Q = query.shape[2]
        K = key.shape[2]
        seen = torch.ones(Q, K, dtype=torch.bool, device=query.device).tril(K - Q)
        if attention_mask is not None:
            seen = attention_mask[:, :, :, :K]
        return attend(query, key, value, seen, dropout, scaling, sinks).transpose(1, 2).contiguous(), None
    window = kwargs.get("sliding_window")  # this layer's; None for full attention
    out = query.new_zeros(query.shape)  # [R, heads, L, head_dim]; a row's padding attends to nothing
    for r, start, stop, keys in segments:
        q = query[r : r + 1, :, start:stop]
        q_depth = torch.arange(len(keys) - (stop - start), len(keys), device=q.device)[:, None]  # the path's last
        first = 0  # the path's first key that the span sees: its root, or the oldest within the window
        if window:
            first = max(0, len(keys) - (stop - start) - window + 1)
        k_depth = torch.arange(first, len(keys), device=q.device)
        seen = k_depth <= q_depth
        if window:
            seen = seen & (q_depth - k_depth < window)
        k = key[r : r + 1, :, keys[first:]]
        v = value[r : r + 1, :, keys[first:]]
        out[r : r + 1, :, start:stop] = attend(q, k, v, seen, dropout, scaling, sinks)
    return out.transpose(1, 2).contiguous(), None


def attend(q, k, v, seen, dropout: float, scaling, sinks=None):
    """SDPA of queries over the keys each has `seen`. Attention sinks (gpt_oss: a learned logit per head in every
    softmax, carrying no value) are one more key per head, of value 0, whose score the float mask sets to the sink."""
    if sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, seen, dropout, scale=scaling, enable_gqa=True)
    B, H, Q = q.shape[:3]
    zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    k = torch.cat([k, zero], 2)
    v = torch.cat([v, zero], 2)
    bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill(~seen, float("-inf"))
    sink = sinks.to(q.dtype).view(1, H, 1, 1).expand(B, H, Q, 1)
    bias = torch.cat([bias.expand(B, H, Q, -1), sink], -1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, bias, dropout, scale=scaling, enable_gqa=True)


def collate(rows: list[dict], samples: list[Sample], pad_id: int, device, packed: bool = True) -> dict:
    """One micro-batch: its rows, padded to the longest (no sample's token sees a pad), and per sample in them the
    loss's [B, T] tensors and where its trained tokens' logprobs come from (`packed_logprobs`): `src`, the flat row
    position of the token before; `tgt`, the token; `pick`, its flat [B, T] position. Packed rows take the trie's mask
    and depth positions; padded rows (one sample each) a plain padding mask, with which the model makes its own."""
    L = max(len(row["ids"]) for row in rows)
    members = [(r, samples[i], path, held) for r, row in enumerate(rows) for i, path, held in row["members"]]
    T = max(len(s.input_ids) for _, s, _, _ in members)
    end = np.tile(np.arange(L), (len(rows), 1))
    src = []  # per sample: the flat row positions its trained tokens' logits come from
    tgt = []  # its trained tokens
    pick = []  # their flat [B, T] positions
    segments = []  # (row, start, stop, path): a span of the row and the keys it sees
    for b, (r, s, path, held) in enumerate(members):
        end[r, path] = path[-1]  # depth first: the last sample through a token ends its subtree
        if held < len(path):  # its own tokens, a span of the row, see its path up to themselves
            segments.append((r, int(path[held]), int(path[-1]) + 1, torch.tensor(path, device=device)))
        t = np.flatnonzero(np.array(s.weights or s.loss_mask)[1:]) + 1  # trained tokens (position 0 never is)
        src.append(r * L + path[t - 1])
        tgt.append(np.array(s.input_ids)[t])
        pick.append(b * T + t)

    def pad(lists, fill, n, dtype=torch.float32):
        return torch.tensor([list(x) + [fill] * (n - len(x)) for x in lists], dtype=dtype, device=device)

    def flat(arrays):
        return torch.tensor(np.concatenate(arrays), dtype=torch.long, device=device)

    in_batch = [s for _, s, _, _ in members]
    pos = None
    attn = pad([[1] * len(row["ids"]) for row in rows], 0, L, torch.long)
    if packed:
        pos = pad([row["pos"] for row in rows], 0, L, torch.long)
        attn = attention_mask(torch.tensor(end, device=device), pos, segments)
    return {
        "ids": pad([row["ids"] for row in rows], pad_id, L, torch.long),
        "pos": pos,
        "attn": attn,
        "src": flat(src),
        "tgt": flat(tgt),
        "pick": flat(pick),
        "mask": pad([s.weights or s.loss_mask for s in in_batch], 0.0, T),  # a trained token's weight, 0 elsewhere
        "sampler_logp": pad([s.sampler_logprobs for s in in_batch], 0.0, T),
        "adv": pad([s.advantages for s in in_batch], 0.0, T),
        "seq_tokens": torch.tensor([float(s.episode_tokens or sum(s.loss_mask)) for s in in_batch], device=device),
    }


LOGPROB_CHUNK = 2**24  # logits elements per float32 chunk in chunk_logprobs (64 MB)


def chunk_logprobs(logits, targets, temperature: float):
    """log_softmax(logits / temperature)[targets] for [N, vocab] logits. With a large vocabulary an [N, vocab] float32
    log-softmax would be most of the activation memory, so float32 exists a chunk of tokens at a time and is
    recomputed in backward (checkpoint): only the model-dtype logits are kept."""
    if temperature <= 0:  # greedy: scored at temperature 1
        temperature = 1.0

    def chunk(x, y):
        logp = torch.log_softmax(x.float() / temperature, -1)
        return logp.gather(-1, y[:, None]).squeeze(-1)

    n = max(1, LOGPROB_CHUNK // logits.shape[-1])  # tokens per chunk
    parts = []
    for x, y in zip(logits.split(n), targets.split(n)):
        parts.append(torch.utils.checkpoint.checkpoint(chunk, x, y, use_reentrant=False))
    return torch.cat(parts)


def prepare_microbatches(model, ref_model, samples: list[Sample], cfg: Config, pad_id: int, device) -> tuple:
    """Micro-batches (packed or padded rows, as `layout` says) with reference logprobs (beta > 0) and pre-update
    policy logprobs (num_iterations > 1, in train mode as the loss's forwards, so dropout acts alike on both sides of
    the ratio). A micro-batch holds max_tokens_per_microbatch tokens (0: micro_batch_size times the longest sample),
    in rows of at most that. Every rank runs as many as the busiest one (FSDP all-gathers in every forward), padded
    with empty ones."""
    packed, _ = layout(getattr(model, "module", model).config)  # DDP holds the model as .module
    longest = max((len(s.input_ids) for s in samples), default=1)
    budget = max(cfg.max_tokens_per_microbatch or cfg.micro_batch_size * longest, longest)
    if packed:
        rows = pack_rows(samples, budget)
    else:
        rows = padded_rows(samples)
    groups = make_microbatches(rows, budget)
    n_mb = int(all_reduce(len(groups), op="max")[0])
    filler = Sample([pad_id], [0], [0.0], [-1], [0.0], versions=[-1])
    empty = [{"ids": [pad_id], "pos": [0], "members": [(len(samples), np.zeros(1, dtype=np.int64), 0)]}]
    fillers = [empty] * (n_mb - len(groups))
    mbs = [collate(g, samples + [filler], pad_id, device, packed) for g in groups + fillers]
    with torch.no_grad(), autocast(cfg, device):
        for mb in mbs:
            if cfg.num_iterations > 1:
                mb["old"] = packed_logprobs(model, mb, cfg.temperature)
            if cfg.beta > 0:  # with LoRA the reference is the policy itself with its adapters off
                with ref_model.disable_adapter() if cfg.lora_rank else contextlib.nullcontext():
                    mb["ref"] = packed_logprobs(ref_model, mb, cfg.temperature)
    held = sum(len(row["ids"]) for row in rows)
    processed = sum(len(g) * max(len(row["ids"]) for row in g) for g in groups)
    held, processed, tokens = all_reduce(held, processed, sum(len(s.input_ids) for s in samples))
    return mbs, {
        "train/processed_tokens": processed,  # what the forward passes read, row padding included
        "train/shared_prefix_tokens_saved": tokens - held,  # tokens of the samples that a shared prefix held once
        "train/row_fill": held / max(processed, 1),  # the packed rows' fill (1 - their padding)
        "train/micro_batches": n_mb,
    }


def lr_lambda(cfg: Config):
    def f(step):  # step counts optimizer updates, num_iterations a train step
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        frac = (step - cfg.warmup_steps) / max(1, cfg.max_steps * cfg.num_iterations - cfg.warmup_steps)
        return {"constant": 1.0, "linear": 1.0 - frac, "cosine": 0.5 * (1 + math.cos(math.pi * frac))}[cfg.lr_scheduler]

    return f


# === E. Checkpoints and resume ===========================================================


def save_checkpoint(cfg: Config, step: int, model, tokenizer, optimizer, scheduler):
    """Written by rank 0 to a temp folder, then renamed: a save that fails (a full disk, a file-size limit) is one
    line, its temp folder removed; a crash mid-save leaves checkpoint-N.tmp, which resume never reads. Either way
    the earlier checkpoints are as they were."""
    model_sd, optim_sd = full_state(model, optimizer, cfg.fsdp)
    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    if dist.is_initialized() and dist.get_rank() != 0:
        return final
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    state = {
        "step": step,
        "optimizer": optim_sd,
        "scheduler": scheduler.state_dict(),
        "config": dataclasses.asdict(cfg),
    }
    state["rng"] = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    state["rng"]["cuda"] = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        model.save_pretrained(tmp, state_dict=model_sd)
        tokenizer.save_pretrained(tmp)
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        # The rename makes the name atomic, not the data durable or a copy whole: after a power loss, or a cp/rsync cut
        # short, files can be short or missing. safetensors and torch.load catch their own; only this list catches the
        # tokenizer's and config's (a missing chat_template.jinja loads a tokenizer without its template, silently).
        sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))}
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump(sizes, f)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    except Exception as e:  # safetensors, torch and json each raise their own type for a failed write
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"could not save {final} ({type(e).__name__}: {' '.join(str(e).split())[:200]}); the earlier "
            "checkpoints are as they were. Free space in output_dir (or raise the file-size limit), then continue "
            "with resume_from_checkpoint=auto"
        ) from None
    return final


def find_checkpoint(cfg: Config, say=print) -> str | None:
    """resume_from_checkpoint: PATH, which must verify, or auto: the newest checkpoint of output_dir that verifies
    (saying which it skipped and why). It must have been saved in the recipe's mode (LoRA or full fine-tuning)."""
    auto = cfg.resume_from_checkpoint == "auto"
    if not cfg.resume_from_checkpoint or auto and not os.path.isdir(cfg.output_dir):
        return None
    found = [cfg.resume_from_checkpoint]
    if auto:
        found = [d for d in os.listdir(cfg.output_dir) if re.fullmatch(r"checkpoint-\d+", d)]
        found = [os.path.join(cfg.output_dir, d) for d in sorted(found, key=lambda d: -int(d[11:]))]  # newest first
    skipped = []
    for path in found:
        problem = checkpoint_problem(path)
        if not problem:
            return checked_mode(cfg, path)
        if not auto:
            raise ConfigError(
                f"resume_from_checkpoint: no checkpoint at '{path}' to resume: {problem}. Choose another "
                "checkpoint, or resume_from_checkpoint=auto (the newest one in output_dir that verifies)"
            )
        say(f"[mt-grpo] skipping {path}: {problem}")
        skipped.append(f"{os.path.basename(path)}: {problem}")
    if skipped:
        raise ConfigError(
            f"resume_from_checkpoint=auto: no checkpoint in '{cfg.output_dir}' can be resumed "
            f"({'; '.join(skipped)}); to start over instead, set resume_from_checkpoint=''"
        )
    return None  # auto, and output_dir holds no checkpoint yet: a fresh start


def checkpoint_problem(path: str) -> str:
    """What makes a checkpoint unusable ('' if nothing): a file missing or of another size than its manifest lists
    (checkpoints saved before the manifest have none), or weights or a trainer state that do not open."""
    from safetensors import safe_open

    files = os.listdir(path) if os.path.isdir(path) else []
    if "trainer_state.pt" not in files:
        return "no trainer_state.pt (expected a checkpoint-N folder)"
    name = "manifest.json"
    sizes = {}
    try:
        if name in files:
            with open(os.path.join(path, name)) as f:
                sizes = json.load(f)
        for name, size in sizes.items():
            have = os.path.getsize(os.path.join(path, name)) if name in files else None
            if have != size:
                return f"{name} is missing" if have is None else f"{name} has {have} bytes, not the {size} saved"
        for name in sorted(f for f in files if f.endswith(".safetensors")):
            safe_open(os.path.join(path, name), "pt")
        name = "trainer_state.pt"
        torch.load(os.path.join(path, name), mmap=True, weights_only=False)  # mmap: the tensors are not read
    except Exception as e:
        return f"{name} does not load ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    return ""


def checked_mode(cfg: Config, path: str) -> str:
    """`path`, if it was saved in the recipe's mode: LoRA (it holds adapter_config.json) with these keys, or full; its
    targets as its run's recipe named them (peft's file lists the modules matched, and loads those whatever is set)."""
    saved = {"lora_rank": 0}
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        with open(os.path.join(path, "adapter_config.json")) as f:
            a = json.load(f)
        run = torch.load(os.path.join(path, "trainer_state.pt"), mmap=True, weights_only=False).get("config", {})
        saved = {"lora_rank": a["r"], "lora_alpha": a["lora_alpha"], "lora_dropout": a["lora_dropout"]}
        saved["lora_target_modules"] = run.get("lora_target_modules", cfg.lora_target_modules)  # older: not saved
    if any(getattr(cfg, k) != v for k, v in saved.items()):
        how = "with LoRA" if saved["lora_rank"] else "by full fine-tuning"
        keys = ", ".join(f"{k}=[{','.join(v)}]" if isinstance(v, list) else f"{k}={v}" for k, v in saved.items())
        raise ConfigError(f"resume_from_checkpoint: {path} was saved {how}: set {keys} to resume it")
    return path


def restore(cfg: Config, ckpt: str, model, optimizer, scheduler, world: int, is_main: bool) -> int:
    """Optimizer, scheduler, RNG state (the model came from `ckpt`); the recipe's learning rate, schedule and AdamW
    settings, where they changed; drops logs of steps to redo; returns the step."""
    state = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)
    if cfg.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scheduler.last_epoch = state["step"] * cfg.num_iterations  # it counts updates, the recipe's num_iterations a step
    # what the checkpoint's run used (before "config" was saved: what its optimizer holds), replaced by the recipe's,
    # so that config.yaml records what is used. The schedule's function is the recipe's (LambdaLR saves no function).
    g = optimizer.param_groups[0]
    old = {"learning_rate": g["initial_lr"], "weight_decay": g["weight_decay"], "adam_betas": list(g["betas"])}
    old.update(state.get("config", {}))
    keys = "learning_rate lr_scheduler warmup_steps max_steps num_iterations weight_decay adam_betas".split()
    changed = [f"{k} {old[k]} -> {getattr(cfg, k)}" for k in keys if k in old and old[k] != getattr(cfg, k)]
    scheduler.base_lrs = [cfg.learning_rate] * len(optimizer.param_groups)
    for g, f in zip(optimizer.param_groups, scheduler.lr_lambdas):
        g.update(initial_lr=cfg.learning_rate, weight_decay=cfg.weight_decay, betas=tuple(cfg.adam_betas))
        g["lr"] = cfg.learning_rate * f(scheduler.last_epoch)
    if world == 1:  # rank 0's streams; with several ranks each keeps its own seed
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])
        if state["rng"]["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    if is_main:
        if changed:
            print(
                f"[mt-grpo] the recipe changes {', '.join(changed)} from {ckpt}'s run: applied from step "
                f"{state['step'] + 1}"
            )
        for name in ("metrics.jsonl", "episodes.jsonl"):
            path = os.path.join(cfg.output_dir, name)
            if os.path.isfile(path):
                with open(path) as f:
                    lines = f.readlines()
                if lines and not lines[-1].endswith("\n"):  # a crash mid-write
                    print(f"[mt-grpo] {name} ends in a torn line (a crash while it was written): dropped it")
                    lines.pop()
                with open(path, "w") as f:
                    f.writelines(line for line in lines if json.loads(line)["step"] <= state["step"])
    return state["step"]


# === F. Loading recipes, plug-ins and data; small utilities =========================


HERE = os.path.dirname(os.path.abspath(__file__))  # this file's folder: shipped recipes, plug-ins, plot.py


class ConfigError(ValueError):
    """A recipe, a plug-in or a dataset that cannot work: one line naming the file or key, and the fix."""


class RecipeLoader(yaml.SafeLoader):
    """YAML where only true/false are booleans, so `tokenization_check: off` stays the string 'off', and where a key
    written twice is an error: YAML would silently keep the last one (a recipe's appended `learning_rate:`)."""

    yaml_implicit_resolvers = {
        k: [(t, re.compile(r"^(?:[tT]rue|TRUE|[fF]alse|FALSE)$") if t.endswith(":bool") else r) for t, r in v]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            mark = key_node.start_mark
            if key in seen:
                where = f" of {mark.name}" if mark.name != "<unicode string>" else ""
                raise ConfigError(
                    f"recipe key '{key}' is set twice, on lines {seen[key] + 1} and {mark.line + 1}{where}; keep one"
                )
            seen[key] = mark.line
        return super().construct_mapping(node, deep)


def field_docs() -> dict[str, str]:
    """Field name -> the docstring written under it (read from this file's source)."""
    body = ast.parse(inspect.getsource(Config)).body[0].body
    return {
        node.target.id: " ".join(nxt.value.value.split())  # as one line, however it is wrapped
        for node, nxt in zip(body, body[1:])
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
    }


def field_rules() -> dict[str, str | tuple]:
    """Field name -> the rule written beside it in Config as `Annotated[type, rule]`: a range, or a tuple of choices
    (a registry's keys as they are now)."""
    return {
        k: rule if isinstance(rule, str) else tuple(rule)
        for k, h in typing.get_type_hints(Config, include_extras=True).items()
        for rule in getattr(h, "__metadata__", ())
    }


def in_range(value: float, interval: str) -> bool:
    """`value` against an interval written beside a field: '[a, b]', '(a, b]', '[a, b)', '>= a', '> a' or
    'finite' (every numeric key must be finite anyway)."""
    if interval == "finite":
        return True
    if interval[0] in "[(":
        lo, hi = (float(x) for x in interval[1:-1].split(","))
        above = lo <= value if interval[0] == "[" else lo < value
        return above and (value <= hi if interval[-1] == "]" else value < hi)
    op, bound = interval.split()
    return value >= float(bound) if op == ">=" else value > float(bound)


def _coerce(name: str, value, typ):
    """Check `value` against the field type; floats take numeric strings (YAML reads 1e-6 so), strings take ints."""
    if typing.get_origin(typ) is list:
        if isinstance(value, list):
            return [_coerce(f"{name}[{i}]", v, typing.get_args(typ)[0]) for i, v in enumerate(value)]
    elif isinstance(value, typ) and (typ is bool or not isinstance(value, bool)):
        return value
    elif typ is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            return float(value)
    elif typ is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    kind = "a list" if typing.get_origin(typ) is list else typ.__name__
    raise ConfigError(f"config key '{name}' must be {kind}, got {type(value).__name__}: {value!r}")


# Ours, not pydantic's: measured (docs/recipe-keys.md), it took 232 more code tokens and a dependency, worse messages.
def read_recipe(path: str) -> tuple[str, dict]:
    """The recipe's path (a shipped recipe from any folder) and its YAML mapping."""
    if path.endswith(".py"):
        raise python_recipe_error(path)
    here = os.path.join(HERE, path)
    if not os.path.isfile(path) and os.path.isfile(here):
        path = here
    if not os.path.isfile(path):
        raise recipe_not_found(path)
    with open(path, "rb") as f:  # bytes: YAML's reader names the file and position of any byte that is not UTF-8
        raw = read_yaml(f, path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a YAML mapping of key: value")
    return path, raw


def load_config(path: str | None = None, overrides: list[str] = (), say=None) -> Config:
    """Recipe YAML + `key=value` overrides -> a checked Config. Unknown keys and wrong types fail. Plug-in and data
    paths are made absolute (`locate_paths`; `say` reports where they were found)."""
    raw = {}
    if path:
        path, raw = read_recipe(path)
    hints, rules = typing.get_type_hints(Config), field_rules()
    overridden = {}  # key -> its override, as written
    for ov in overrides:
        if "=" not in ov:
            raise ConfigError(f"override '{ov}' must look like key=value")
        k, v = ov.split("=", 1)
        k = k.strip()
        overridden[k] = ov.strip()
        raw[k] = v if hints.get(k) is str else read_yaml(v, f"the value of override '{ov}'") if v.strip() else ""
    if isinstance(raw.get("vllm_server_url"), str):  # one URL alone, or several comma-separated
        raw["vllm_server_url"] = [u.strip() for u in raw["vllm_server_url"].split(",") if u.strip()]
    values = {}
    for k, v in raw.items():
        if k not in hints:
            close = difflib.get_close_matches(k, hints, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else "; see `python mt_grpo_trainer.py --help`"
            where = f" in the override '{overridden[k]}' on the command line" if k in overridden else f" in {path}"
            raise ConfigError(f"unknown config key '{k}'{where if path or k in overridden else ''}{hint}")
        values[k] = _coerce(k, v, hints[k])
        rule = rules.get(k)
        if isinstance(rule, tuple) and values[k] not in rule:
            raise ConfigError(f"config key '{k}' must be one of {', '.join(rule)}, got {v!r}")
        if isinstance(rule, str) and not all(math.isfinite(x) and in_range(x, rule) for x in np.atleast_1d(values[k])):
            kind = rule if rule[0] in "<>f" else "in " + rule
            raise ConfigError(f"{k} must be {kind}, got {v!r} ({field_docs()[k]})")
    cfg = Config(**values)
    for level in ("turn", "outcome"):
        funcs = f"{level}_reward_funcs"
        weights = f"{level}_reward_weights"
        w = getattr(cfg, weights)
        if w and len(w) != len(getattr(cfg, funcs)):
            raise ConfigError(f"'{weights}' has {len(w)} entries but '{funcs}' has {len(getattr(cfg, funcs))}")
    if len(cfg.adam_betas) != 2:
        raise ConfigError(f"adam_betas must be two numbers [beta1, beta2], got {cfg.adam_betas}")
    check_branching(cfg)
    for i, url in enumerate(cfg.vllm_server_url):
        if not re.fullmatch(r"https?://[^/\s]+/?", url) or url in cfg.vllm_server_url[:i]:
            raise ConfigError(
                f"vllm_server_url: {url!r} is not a server URL or is there twice; write each http://HOST:PORT once"
            )
    if not cfg.output_dir:
        cfg.output_dir = os.path.join("runs", os.path.splitext(os.path.basename(path))[0] if path else "default")
    named = [ov for k, ov in overridden.items() if k not in UNNAMED_OVERRIDES]
    if named and "output_dir" not in overridden:  # an ablation gets a folder of its own: runs/NAME--key=value
        cfg.output_dir = cfg.output_dir.rstrip("/") + "--" + re.sub(r"[^\w.=,+-]", "_", "--".join(named))
    locate_paths(cfg, path, say)
    return cfg


# overrides that do not change what a run learns, so they do not name its folder (a resume finds the run's own)
UNNAMED_OVERRIDES = {
    "output_dir", "resume_from_checkpoint", "max_steps", "save_steps", "log_episodes_steps", "report_to",
    "wandb_project", "eval_dataset", "eval_steps", "eval_max_examples", "vllm_server_url", "vllm_gpus", "train_gpus",
    "vllm_tensor_parallel_size", "vllm_gpu_memory_utilization", "sync_check",
}  # fmt: skip


def locate_paths(cfg: Config, recipe: str | None, say=None):
    """Plug-in and data paths, made absolute: relative to the recipe's folder first, then the working folder, then
    this file's folder. model_name_or_path is taken where model_builder's file was found (so a missing model is built
    beside its builder), else where it exists; a hub id stays as it is. `say` names each folder used past the first."""
    bases = [os.path.dirname(os.path.abspath(recipe))] if recipe else []
    bases += [os.getcwd(), HERE]
    found_in = {}  # path as written -> the folder it was found in

    def find(p: str, only: str | None = None) -> str:
        p = os.path.expanduser(p)
        if not p or os.path.isabs(p):
            return p
        for base in [only] if only else bases:
            full = os.path.normpath(os.path.join(base, p))
            if only or os.path.exists(full):
                found_in[p] = base
                return full
        return p  # not found anywhere: left as written, for the loader's "not found" line

    def spec(s: str) -> str:
        if s.endswith(".jsonl") or ":" not in s:
            return find(s)
        file, name = s.rsplit(":", 1)
        return f"{find(file)}:{name}"

    cfg.tools = [spec(s) for s in cfg.tools]
    cfg.turn_reward_funcs = [spec(s) for s in cfg.turn_reward_funcs]
    cfg.outcome_reward_funcs = [spec(s) for s in cfg.outcome_reward_funcs]
    cfg.dataset = spec(cfg.dataset)
    cfg.eval_dataset = spec(cfg.eval_dataset)
    builder_file = os.path.expanduser(cfg.model_builder.rsplit(":", 1)[0])
    cfg.model_builder = spec(cfg.model_builder)
    cfg.model_name_or_path = find(cfg.model_name_or_path, found_in.get(builder_file))
    for base in dict.fromkeys(b for b in found_in.values() if b != bases[0] and say):
        paths = ", ".join(p for p, b in found_in.items() if b == base)
        say(f"[mt-grpo] {paths}: not beside the recipe, taken from {base}")


def check_branching(cfg: Config):
    """branch_width > 1: G leaves from at least 2 roots, a mode that reads the tree, and token_mean."""
    if cfg.branch_width == 1:
        return
    leaves = cfg.branch_width**cfg.branch_depth
    if cfg.num_generations % leaves or cfg.num_generations // leaves < 2:
        raise ConfigError(
            f"num_generations={cfg.num_generations} must be a multiple of branch_width^branch_depth = {leaves}, at "
            f"least twice (the roots of a tree, which need each other as baseline); e.g. num_generations={2 * leaves}"
        )
    if cfg.advantage_mode in INDEPENDENT_MODES:
        raise ConfigError(
            f"branch_width={cfg.branch_width} needs advantage_mode: tree; {cfg.advantage_mode} takes a group's "
            "episodes as independent, and branches share their tokens"
        )
    if cfg.loss_aggregation != "token_mean":
        raise ConfigError("branch_width > 1 needs loss_aggregation: token_mean (a shared token has no one episode)")


def read_yaml(stream, where: str):
    """YAML as recipes read it; a syntax error is one line naming `where`, the line and the problem."""
    try:
        return yaml.load(stream, Loader=RecipeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        problem = getattr(e, "problem", None) or getattr(e, "reason", e)
        at = f", line {mark.line + 1}, column {mark.column + 1}" if mark else f", position {getattr(e, 'position', 0)}"
        if getattr(e, "context_mark", None):  # e.g. an unclosed '[': where it opened
            problem += f" ({e.context} from line {e.context_mark.line + 1}, column {e.context_mark.column + 1})"
        fix = "save it as UTF-8 text" if isinstance(e, yaml.reader.ReaderError) else "quote values with ': ' or ' #'"
        raise ConfigError(f"{where}{at}: not valid YAML: {problem}; fix it there ({fix})") from None


COMMANDS = ("train", "eval", "check-template", "merge-lora", "plot", "show", "help")  # and run.sh's own: serve, test
PLUGIN_KEYS = {
    "reward": "outcome_reward_funcs",
    "eval": "eval_dataset",
    "dataset": "dataset",
    "agent": "agent",
}  # guessed


def recipe_not_found(path: str) -> ConfigError:
    """A recipe that is not there, often a mistyped command or path: the commands, and the nearest of both."""
    recipes = glob.glob("hf_recipes/**/*.yaml", root_dir=HERE, recursive=True)
    recipes += glob.glob(os.path.join(os.path.dirname(path), "*.y*ml"))
    close = difflib.get_close_matches(path, [*COMMANDS, "serve", "test"], n=1, cutoff=0.7)
    close += difflib.get_close_matches(path, recipes, n=1, cutoff=0.8)  # a path shares its folder with the others
    hint = ""
    if close:
        hint = f" (did you mean '{close[0]}'?)"
    commands = ", ".join(COMMANDS)
    return ConfigError(
        f"recipe not found: {path}{hint}. Commands: {commands} (run.sh also: serve, test); a recipe is a YAML file, "
        "as in hf_recipes/"
    )


def python_recipe_error(path: str) -> ConfigError:
    """A .py given as the recipe: a recipe is YAML, and the functions the file defines are named in one by path."""
    here = os.path.join(HERE, path)  # a shipped plug-in, from any folder
    full = here if not os.path.isfile(path) and os.path.isfile(here) else path
    names = []
    if os.path.isfile(full):  # read, not run: its top-level functions
        with contextlib.suppress(SyntaxError, ValueError, UnicodeDecodeError), open(full) as f:
            names = [n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)]
    examples = []
    for name in names:
        key = next((k for word, k in PLUGIN_KEYS.items() if word in name), None)  # a tool can have any name
        if key == "outcome_reward_funcs":  # a list key
            examples.append(f"'{key}: [{path}:{name}]'")
        elif key:
            examples.append(f"'{key}: {path}:{name}'")
    if not examples:
        examples = [f"'dataset: {path}:make_dataset'", f"'tools: [{path}:my_tool]'"]
    name_them = "e.g. " + ", ".join(examples[:3])
    return ConfigError(
        f"{path} is Python, but a recipe is a YAML file of key: value (as in hf_recipes/). A plug-in the .py defines "
        f"is named in a recipe by path:function, {name_them}; then run that recipe"
    )


def print_help():
    docs = field_docs()
    hints = typing.get_type_hints(Config)
    rules = field_rules()
    print(
        __doc__.split("\n\nThe invariants")[0]
        + "\n\nusage: python mt_grpo_trainer.py [train] RECIPE.yaml [key=value ...]\n"
        "       python mt_grpo_trainer.py eval RECIPE.yaml [key=value ...]   (on eval_dataset, at eval_temperature)\n"
        "       python mt_grpo_trainer.py check-template --tokenizer DIR_OR_HUB_ID [--json] ...\n"
        "       python mt_grpo_trainer.py merge-lora CHECKPOINT OUT_DIR   (a LoRA checkpoint as one HF model)\n"
        "       python mt_grpo_trainer.py plot RUN_DIR [RUN_DIR ...] [--out FILE]   (curves; several runs on one)\n"
        "       python mt_grpo_trainer.py show RUN_DIR [--step N] [--worst|--best] [--html]   (episodes, turn by turn)\n\n"
        "recipe keys:"
    )
    for name, default in dataclasses.asdict(Config()).items():
        rule = rules.get(name, "")
        valid = f"; one of {', '.join(rule)}" if isinstance(rule, tuple) else f", range {rule}" if rule else ""
        kind = getattr(hints[name], "__name__", hints[name])
        print(f"  {name} ({kind}, default {default!r}{valid})\n      {docs.get(name, '')}")


def plugin_file(spec: str, what: str) -> tuple[str, str]:
    """`path/to/file.py:name` -> the file, relative to the working folder or this file, and the name."""
    if ":" not in spec:
        raise ConfigError(f"{what} '{spec}' must look like path/to/file.py:function_name")
    path, name = spec.rsplit(":", 1)
    here = os.path.join(HERE, path)
    full = path if os.path.isfile(path) else here if os.path.isfile(here) else None
    if full is None:
        raise ConfigError(f"{what} file not found: '{path}' (from '{spec}')")
    return full, name


def load_object(spec: str, what: str = "object"):
    """`path/to/file.py:name` -> that object. Paths are relative to the working folder or this file."""
    full, name = plugin_file(spec, what)
    path = spec.rsplit(":", 1)[0]
    mod_name = "mtgrpo_plugin_" + re.sub(r"\W", "_", os.path.abspath(full))
    module = sys.modules.get(mod_name)
    if module is None:
        spec_ = importlib.util.spec_from_file_location(mod_name, full)
        sys.modules[mod_name] = module = importlib.util.module_from_spec(spec_)
        folder = os.path.dirname(os.path.abspath(full))
        sys.path.insert(0, folder)  # its siblings import (`from calc import rows`), as when the file runs as a script
        try:
            spec_.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            del sys.modules[mod_name]  # the next load runs the file again, not a half-made module
            raise plugin_error(e, f"{what} file '{path}' failed on import") from None
        finally:
            sys.path.remove(folder)
    if not hasattr(module, name):
        raise ConfigError(f"{what} '{name}' not found in {path}")
    return getattr(module, name)


def plugin_error(e: BaseException, what: str) -> ConfigError:
    """A plug-in's exception as one line, at its deepest frame in the user's code (not Python's, a package's, ours)."""
    python = (os.path.dirname(os.__file__), "<")  # the standard library, frozen importlib
    frames = [
        (f.filename, f.lineno)
        for f in traceback.extract_tb(e.__traceback__)
        if not f.filename.startswith(python) and "-packages" not in f.filename and f.filename != __file__
    ]
    at = f" ({frames[-1][0]}, line {frames[-1][1]})" if frames else ""  # a SyntaxError names its own file and line
    fix = "install the missing package" if isinstance(e, ImportError) else "fix it there"
    return ConfigError(f"{what}: {type(e).__name__}: {' '.join(str(e).split()):.300}{at}; {fix}")


def load_rows(spec: str) -> list[dict]:
    """A dataset's rows (a .jsonl file or file.py:function), checked: JSON objects with one set of columns, each
    with a prompt the chat template can render (a row that fails would otherwise crash the step that draws it)."""
    lines = []  # for a .jsonl file, each row's line in it
    if spec.endswith(".jsonl"):
        if not os.path.isfile(spec):
            raise ConfigError(f"dataset file not found: {spec}")
        with open(spec, "rb") as f:  # bytes, which json.loads decodes: a byte that is not UTF-8 is named in its line
            numbered = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
        lines = [n for n, _ in numbered]
        rows = []
        for n, line in numbered:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:  # its own line number counts within the line
                raise ConfigError(
                    f"dataset {spec}, line {n}, column {e.colno}: not JSON ({e.msg}); each line must be one JSON object"
                ) from None
            except UnicodeDecodeError as e:
                raise ConfigError(
                    f"dataset {spec}, line {n}: byte {e.start} of the line is not UTF-8 ({e.reason}); "
                    "save the file as UTF-8"
                ) from None
    else:
        fn = load_object(spec, "dataset function")
        try:
            rows = list(fn())
        except (Exception, SystemExit) as e:
            raise plugin_error(e, f"dataset function '{spec}' raised") from None
    if not rows:
        raise ConfigError(f"dataset '{spec}' has no rows")
    cols = set(rows[0]) if isinstance(rows[0], dict) else set()  # reward functions get every column for every episode
    for i, r in enumerate(rows):
        at = f"dataset '{spec}'" + (f", line {lines[i]}" if lines else "") + f": row {i}"
        if not isinstance(r, dict) or "prompt" not in r:
            raise ConfigError(f"{at} is {r!r:.80}, not an object with a 'prompt' column")
        p = r["prompt"]
        bad = [
            j
            for j, m in enumerate(p if isinstance(p, list) else [])
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str))
        ]
        if not (p.strip() if isinstance(p, str) else isinstance(p, list) and p and not bad):
            what = f"prompt message {bad[0]}: {p[bad[0]]!r:.80}" if bad else f"prompt {p!r:.80}"
            raise ConfigError(
                f"{at} has {what}; a prompt must be a non-empty string or a non-empty list of "
                '{"role": str, "content": str} messages'
            )
        if set(r) != cols:  # a missing column must not reach a reward function as None
            missing = sorted(cols - set(r))
            extra = sorted(set(r) - cols)
            diff = f"lacks column(s) {', '.join(missing)}" if missing else f"has column(s) {', '.join(extra)}"
            raise ConfigError(f"{at} {diff} that row 0 does not; every row needs the same columns")
    return rows


def autocast(cfg: Config, device: torch.device):
    mode = cfg.mixed_precision
    use = mode == "bf16" or mode == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=use)


class DaemonPool:
    """Worker threads for tool calls, reward functions and server requests, at most `size`. Started as calls come and
    gone after IDLE_EXIT seconds without one, so a pool holds no threads between runs. Daemons: a call that never
    returns is abandoned with its worker (`wait` lets a fresh one take its place), and none keeps the process alive."""

    IDLE_EXIT = 5.0

    def __init__(self, size: int):
        self.size = size
        self.jobs = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.alive = 0
        self.idle = 0  # workers waiting for a call, less the calls queued: below 0, calls wait for a worker

    def add_worker(self):
        self.alive += 1
        self.idle += 1
        threading.Thread(target=self.work, daemon=True, name="tool").start()

    def work(self):
        while True:
            try:
                fn, kwargs, fut = self.jobs.get(timeout=self.IDLE_EXIT)
            except queue.Empty:
                with self.lock:
                    if self.idle > 0:  # more workers wait than calls are queued: this one may go
                        self.idle -= 1
                        self.alive -= 1
                        return
                continue
            fut.started = time.monotonic()  # a tool call is timed from here, not from when it was queued
            try:
                fut.set_result(fn(**kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            with self.lock:
                if getattr(fut, "abandoned", False):
                    return  # `wait` gave up on it and already let a fresh worker take its place
                self.idle += 1

    def submit(self, fn, **kwargs) -> concurrent.futures.Future:
        fut = concurrent.futures.Future()
        with self.lock:
            self.idle -= 1
            self.jobs.put((fn, kwargs, fut))
            if self.idle < 0 and self.alive < self.size:
                self.add_worker()
        return fut

    def abandon(self, fut: concurrent.futures.Future):
        """Its worker may never come back: it leaves the count, and a fresh one starts if calls are waiting."""
        with self.lock:
            if fut.done():
                return  # it came back after all: its worker is free again
            fut.abandoned = True
            self.alive -= 1
            if self.idle < 0:
                self.add_worker()

    def wait(self, fut: concurrent.futures.Future, timeout: float, stop_event: threading.Event | None = None):
        """A call's exception (None once it returned). TimeoutError once it has run `timeout` seconds since a worker
        took it (time queued behind other calls does not count); Stopped as soon as `stop_event` is set. Either way
        its worker may never come back: it is abandoned, and a fresh one keeps the pool's size."""
        while True:
            started = getattr(fut, "started", None)
            left = math.inf if started is None else started + timeout - time.monotonic()
            try:
                return fut.exception(timeout=max(0.0, min(left, 0.05)))
            except concurrent.futures.TimeoutError:
                if left <= 0.05:
                    self.abandon(fut)
                    raise
                if stop_event is not None and stop_event.is_set():
                    self.abandon(fut)
                    raise Stopped(
                        "SIGTERM or Ctrl-C stopped the run while a reward function ran; saved checkpoints are unaffected"
                    ) from None


def tool_schema(fn) -> dict:
    """OpenAI-style JSON schema of a tool from its signature and docstring (Google-style `Args:` lines)."""
    doc = inspect.getdoc(fn) or ""
    arg_docs = dict(re.findall(r"^\s*(\w+)\s*(?:\([^)]*\))?:\s*(.+)$", doc.partition("Args:")[2], re.M))
    hints = typing.get_type_hints(fn)
    json_type = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}
    props = {}
    required = []
    for name, p in inspect.signature(fn).parameters.items():
        t = hints.get(name, str)
        props[name] = {"type": json_type.get(typing.get_origin(t) or t, "string")}
        if name in arg_docs:
            props[name]["description"] = arg_docs[name].strip()
        if p.default is inspect.Parameter.empty:
            required.append(name)
    params = {"type": "object", "properties": props, "required": required}
    summary = doc.split("\n\n")[0].replace("\n", " ")
    return {"type": "function", "function": {"name": fn.__name__, "description": summary, "parameters": params}}


def system_prompt_for(cfg: Config, tools: list) -> str:
    lines = [f"- {t.__name__}{inspect.signature(t)}: {tool_schema(t)['function']['description']}" for t in tools]
    return cfg.system_prompt.replace("{tools}", "\n".join(lines))


class TokenizationMismatch(RuntimeError):
    """A sample's last prompt is not what a fresh rendering gives (I5; see ChatTemplate.check_tokenization)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written: the run stops (its earlier checkpoints stand)."""


class SyncCheckError(RuntimeError):
    """After a weight sync the server's logprobs do not follow the trainer's weights: the run stops."""


class RewardError(ConfigError):
    """A reward function raised, hung, or returned the wrong length or a non-number: the run stops (I6)."""


class Stopped(RewardError):
    """SIGTERM or a first Ctrl-C while a reward function ran: train() drops the step, saves the last completed one."""


def reward_name(fn) -> str:
    return getattr(fn, "__name__", str(fn))


def record_rewards(run, episodes: list[Episode]):
    """Each reward function's own value on every episode, in ep.rewards (what evaluation reports), unweighted."""
    timeout = run.cfg.reward_timeout
    score(episodes, run.turn_fns, [1.0] * len(run.turn_fns), timeout, per_turn=True)
    score(episodes, run.outcome_fns, [1.0] * len(run.outcome_fns), timeout)


def call_reward(fn, completions: list, columns: dict, timeout: float, stop_event=None, per_turn=False) -> list:
    """`fn(completions, **columns)`, checked: one finite number per episode (`per_turn`: or a list of them, one per
    assistant message of the episode's completion). It runs in a worker on its own copy of
    both (an edit it makes reaches neither the next function nor the episode), for at most `timeout` seconds, and
    is abandoned at once when `stop_event` is set (a function may never return)."""
    file = getattr(getattr(fn, "__code__", None), "co_filename", type(fn).__name__)
    where = f"reward function '{reward_name(fn)}' ({file})"
    own, cols = copy.deepcopy((completions, columns))
    fut = reward_pool().submit(functools.partial(fn, own, **cols))
    try:
        err = reward_pool().wait(fut, timeout, stop_event)
    except concurrent.futures.TimeoutError:
        raise RewardError(f"{where} did not return within reward_timeout={timeout}s; saved checkpoints are unaffected")
    if err:  # a reward function runs in a worker thread, where signal-based timeouts (math_verify's) cannot work
        hint = "; it runs in a worker thread: turn off its signal-based timeout" if "main thread" in str(err) else ""
        raise RewardError(
            f"{where} raised {type(err).__name__}: {err}{hint}  (dataset columns: {', '.join(columns)})"
        ) from err
    vals = fut.result()
    if not isinstance(vals, (list, tuple)) or len(vals) != len(completions):
        raise RewardError(f"{where} must return a list of {len(completions)} floats, got {vals!r:.200}")

    def number(v, i: int) -> float:
        if not (isinstance(v, (numbers.Real, np.bool_)) or (torch.is_tensor(v) and v.ndim == 0)):
            lists = " or a list of them, one per assistant turn" if per_turn else ""
            raise RewardError(
                f"{where} returned {v!r:.100} for episode {i}, not a number but a {type(v).__name__}: "
                f"return ints, floats or bools (numpy and 0-d torch scalars are fine){lists}"
            )
        if not math.isfinite(float(v)):
            raise RewardError(f"{where} returned {float(v)} for episode {i}")
        return float(v)

    out = []
    for i, (v, completion) in enumerate(zip(vals, completions)):
        turns = sum(m["role"] == "assistant" for m in completion)
        if per_turn and isinstance(v, (list, tuple)) and len(v) != turns:
            raise RewardError(f"{where} returned {len(v)} values for episode {i}, which has {turns} assistant turns")
        out.append([number(x, i) for x in v] if per_turn and isinstance(v, (list, tuple)) else number(v, i))
    return out


@functools.cache
def reward_pool() -> DaemonPool:
    """The worker reward functions run on, made on first use: its caller waits with a bound (see score)."""
    return DaemonPool(1)


# === G. The chat template: the text each prompt renders, and the text each sample holds (the method: I4, I5) =====

BRIDGE_CHECKS = 3  # an env's first bridged prompts, each compared with the full rendering (see ChatTemplate.bridge)


class ChatTemplate:
    """The environment's side of the chat template: the conversation's text under thinking_retention (I5), each
    sample's held text beside its ids, the bridge, REALIGN's cut point, and the episode-end tokenization check."""

    def __init__(self, tokenizer, fmt, cfg: Config):
        self.tok = tokenizer
        self.fmt = fmt
        self.cfg = cfg
        self.bridge_checks = 0  # bridged prompts found equal to the full rendering so far; -1: the bridge is off
        self.stubs = {}  # the bridge's stub -> its rendering without and with the generation prompt

    def apply(self, messages: list[dict], add_generation_prompt=False) -> str:
        """The template's text for `messages`, with the tools' schemas (native format) and chat_template_kwargs."""
        kw = dict(tools=self.fmt.schemas, add_generation_prompt=add_generation_prompt, **self.cfg.chat_template_kwargs)
        return self.tok.apply_chat_template(messages, tokenize=False, **kw)

    @functools.cached_property
    def one_call_per_turn(self) -> bool:
        """Whether the chat template refuses an assistant message with several tool calls (Llama 3.1's raises)."""
        from jinja2 import TemplateError

        call = {"type": "function", "function": {"name": "f", "arguments": {}}}
        two_calls = [{"role": "user", "content": "."}, {"role": "assistant", "content": "", "tool_calls": [call] * 2}]
        with contextlib.suppress(TemplateError):
            self.apply(two_calls)
            return False
        return True

    def norm(self, text: str) -> str:
        """Text as the tokenizer reads it. Qwen's tokenizers NFC-normalise, so a decomposed character ("n\u0303") would
        come back composed from its ids: the held text and a fresh rendering would differ (a false fork or mismatch)."""
        from tokenizers import normalizers as N

        n = getattr(getattr(self.tok, "backend_tokenizer", None), "normalizer", None)
        if not isinstance(n, (N.NFC, N.NFKC, N.NFD, N.NFKD)) or unicodedata.is_normalized(type(n).__name__, text):
            return text  # this quick check reads a long rendering 15x faster than the tokenizer's normalizer
        return n.normalize_str(text)

    def enc(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def dec(self, ids: list[int]) -> str:
        """The ids' text, normalised as the tokenizer reads text (as a re-encoding gives it); ids stay as sampled."""
        return self.norm(self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    def is_query(self, m: dict) -> bool:
        """A user query: a user message that is not one of the tool format's results."""
        return m["role"] == "user" and not self.fmt.is_result(m)

    def verbatim_turns(self, messages, sampled_texts: dict[int, str]) -> set[int]:
        """Assistant messages whose sampled text (thinking included) is shown verbatim, per thinking_retention:
        template: none (the template decides); tool_cycle: those of the in-flight tool cycle (after the
        last user query, once a tool result is in it); all: every one."""
        mode = self.cfg.thinking_retention
        if mode == "all":
            return set(sampled_texts)
        if mode == "tool_cycle":
            last_query = max((i for i, m in enumerate(messages) if self.is_query(m)), default=-1)
            if any(map(self.fmt.is_result, messages[last_query + 1 :])):
                return {i for i in sampled_texts if i > last_query}
        return set()

    def render(
        self, messages, sampled_texts: dict[int, str], add_generation_prompt=True, verbatim: set | None = None
    ) -> str:
        """The chat template's text for the conversation under thinking_retention (I5): turns kept verbatim are
        rendered as placeholders, then replaced by their sampled text. Compaction (every N turns) strips the thinking
        of turns before the last multiple of N of the turns in `sampled_texts`."""
        n = self.cfg.thinking_compaction_turns
        compacted = set(sorted(sampled_texts)[: len(sampled_texts) // n * n if n else 0])
        msgs = [
            {**m, "content": THINK_RE.sub("", m["content"])} if i in compacted else m for i, m in enumerate(messages)
        ]
        # The final message is the template's to render (Qwen3 gives a final turn its own <think> handling).
        final = set() if add_generation_prompt else {len(messages) - 1}
        if verbatim is None:
            verbatim = self.verbatim_turns(messages, sampled_texts)
        holes = {i: f"\u27e6mt-grpo turn {i}\u27e7" for i in verbatim - compacted - final}
        for i, h in holes.items():
            msgs[i] = {"role": "assistant", "content": h}
        text = self.apply(msgs, add_generation_prompt=add_generation_prompt)
        for i, h in holes.items():
            assert text.count(h) == 1, f"chat template did not render assistant message {i} exactly once"
            text = text.replace(h, sampled_texts[i])
        return self.norm(text)  # sampled text and tool docstrings may hold what the tokenizer normalises

    def forced_prefix(self, messages, sampled_texts, prompt_text: str) -> str:
        """Text the generation prompt adds beyond the template's history header for an assistant turn (Qwen3's
        `<think>\n\n</think>\n\n` with enable_thinking=false): part of the next turn, kept verbatim with it."""
        verbatim = self.verbatim_turns(messages, sampled_texts)  # the probe's extra user message must not change it
        base = self.render(messages, sampled_texts, False, verbatim=verbatim)
        hole = "\u27e6mt-grpo next\u27e7"  # followed by a user message, so it is rendered as history
        probe = messages + [{"role": "assistant", "content": hole}, {"role": "user", "content": "."}]
        probe = self.render(probe, sampled_texts, False, verbatim=verbatim)
        if not (prompt_text.startswith(base) and probe.startswith(base) and hole in probe):
            return ""
        gen = prompt_text[len(base) :]
        header = probe[len(base) : probe.index(hole)]
        return gen[len(header) :] if gen.startswith(header) else ""

    def append(self, s: Sample, ids: list[int], **kw):
        """Append to a sample and to its held text. The new ids are decoded apart from the rest (so no turn decodes the
        whole sample) where that gives the same text, checked on the tokens either side (a split character, a combining
        mark NFC joins to the one before); else the whole is decoded."""
        dec = self.dec
        edge = s.input_ids[-4:]
        s.text = s.text + dec(ids) if dec(edge + ids[:4]) == dec(edge) + dec(ids[:4]) else dec(s.input_ids + ids)
        s.append(ids, **kw)

    def bridge(self, ep: Episode, s: Sample) -> str | None:
        """The next prompt without rendering the whole conversation, at a tool boundary (the new messages are the
        sampled turn and its tool results): the held text up to the last turn's generation prompt, then the
        template's rendering of only the new messages after a stub of the first message and the last user query.
        Declines (None, so the caller renders in full) at a user query (templates rewrite history there), with
        thinking_retention other than template, after an edited history, and for good once it has differed from the full rendering on one
        of its first BRIDGE_CHECKS uses, which are compared with it, or the template has refused its stub (Gemma's
        roles must alternate: without a system message the stub is two user messages). The episode-end tokenization
        check is the net."""
        from jinja2 import TemplateError

        cfg = self.cfg
        if (
            self.bridge_checks < 0
            or cfg.thinking_retention != "template"
            or cfg.thinking_compaction_turns
            or ep.rewritten  # an agent harness edited what it was sent
        ):
            return None
        last = max(ep.sampled_texts)  # the sampled assistant message
        new = ep.messages[last:]
        if any(map(self.is_query, new)):
            return None
        query = max((i for i in range(last) if self.is_query(ep.messages[i])), default=0)
        stub = [ep.messages[i] for i in sorted({0, query})]
        key = json.dumps([stub, cfg.chat_template_kwargs], sort_keys=True)  # a tool cycle's stub: render it once
        try:
            if key not in self.stubs:
                kept = self.stubs if len(self.stubs) < 256 else {}
                self.stubs = {**kept, key: (self.apply(stub), self.apply(stub, add_generation_prompt=True))}
            base, gen = self.stubs[key]
            full = self.apply(stub + new, add_generation_prompt=True)
        except TemplateError:  # the conversation itself may still render: the caller renders it whole
            self.bridge_checks = -1
            return None
        start = s.prompt_chars - (len(gen) - len(base))  # where the sampled turn's message begins in the held text
        text = s.text[:start] + self.norm(full[len(base) :]) if gen.startswith(base) and full.startswith(base) else None
        if self.bridge_checks < BRIDGE_CHECKS:
            self.bridge_checks = self.bridge_checks + 1 if text == self.render(ep.messages, ep.sampled_texts) else -1
        return text if self.bridge_checks >= 0 else None

    def realign_point(self, s: Sample, text: str) -> tuple[int, str] | None:
        """REALIGN (a tail wobble, not a rewrite): the fresh rendering keeps everything before the last turn's sampled
        tokens and departs inside them, and the at most realign_max_tokens of them past the departure are whitespace or
        special tokens (a trimmed newline, a re-rendered end marker). The held tokens to keep and their text, or None."""
        lp = s.last_prompt_len
        n = self.cfg.realign_max_tokens
        head = s.text[: s.prompt_chars]
        tail = s.input_ids[lp:]
        if not n or not text.startswith(head):
            return None
        for k in range(len(tail) - 1, max(len(tail) - n, 0) - 1, -1):  # keep the most sampled tokens that still match
            kept = head + self.dec(tail[:k])
            if text.startswith(kept):
                gone = self.tok.decode(tail[k:], skip_special_tokens=True, clean_up_tokenization_spaces=False)
                rest = gone[len(os.path.commonprefix([gone, text[len(kept) :]])) :]  # what the fresh text lacks
                return (lp + k, kept) if not rest.strip() else None
        return None  # no cut within realign_max_tokens of the end: a fork

    def check_tokenization(self, ep: Episode) -> int:
        """I5: each sample's last prompt must equal a fresh rendering of the messages before its last turn, with the
        generation prompt (a last turn rendered differently as history makes the next turn fork instead). Returns the
        number of mismatches; raises on one unless it is whitespace-only under `ignore_strippable`."""
        mode = self.cfg.tokenization_check
        found = 0
        if mode == "off":
            return 0
        for k, s in enumerate(ep.samples):
            if s.text != self.dec(s.input_ids):  # what the bridge and extension compared: a bug, not a template's
                raise TokenizationMismatch(
                    f"sample {k}'s held text is not its ids decoded: a bug in ChatTemplate.append"
                )
            if not s.n_messages:
                continue
            last = s.n_messages - 1  # the sample's last assistant message
            held = self.dec(s.input_ids[: s.last_prompt_len])
            fresh = self.render(ep.messages[:last], {i: r for i, r in ep.sampled_texts.items() if i < last})
            if fresh == held:
                continue
            found += 1
            if mode == "ignore_strippable" and "".join(fresh.split()) == "".join(held.split()):
                continue
            at = len(os.path.commonprefix([held, fresh]))  # the first character that differs
            raise TokenizationMismatch(
                f"sample {k} of an episode: its last prompt differs from a fresh rendering of the conversation before "
                f"its last turn (thinking_retention={self.cfg.thinking_retention}) at character {at}:\n"
                f"  trained : ...{held[max(0, at - 80) : at + 80]!r}\n  template: ...{fresh[max(0, at - 80) : at + 80]!r}\n"
                "Check the chat template with `python mt_grpo_trainer.py check-template`, or set "
                "tokenization_check: ignore_strippable (whitespace-only differences) or off."
            )
        return found


# === H. Agent harnesses: an OpenAI-compatible endpoint per episode, each request one turn of the environment ======

AGENT_MODEL = "policy"  # the one model the endpoint serves
BATCH_WINDOW = 0.05  # seconds the sampling thread waits for one more request, unless every running harness sent one
TRAINER_ENDS = ("truncated", "max_env_steps", "context", "replay_diverged")  # the trainer ends these, not the harness
# Request fields, decided one by one (docs/agents.md). Refused with a 400 that names the field, when set otherwise:
REFUSED = {
    "n": (1, "one choice per request: each request is one turn of one episode"),
    "logprobs": (False, "the trainer records the sampled tokens' logprobs itself; this endpoint returns none"),
    "top_logprobs": (0, "the trainer records the sampled tokens' logprobs itself; this endpoint returns none"),
    "stop": (None, "the tool format decides where a turn stops"),
    "presence_penalty": (0, "a penalty changes the distribution the trainer trains on"),
    "frequency_penalty": (0, "a penalty changes the distribution the trainer trains on"),
    "logit_bias": (None, "a bias changes the distribution the trainer trains on"),
}
OVERRIDDEN = ("temperature", "top_p")  # the trainer's, whatever a request says; each difference counted
# What each episode's base_url, /episodes/<key>/v1, serves:
ROUTES = (("POST", "chat/completions"), ("POST", "responses"), ("GET", "models"))
# The fields of an episode that a request sets before its prompt renders:
REQUEST_SETS = ("messages", "rewritten", "n_prompt_messages", "sampled_texts", "done", "end_reason")
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 410: "gone", 500: "server_error"}


class AgentError(RuntimeError):
    """A request the endpoint answers with an error status, which it names."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class AgentEpisode:
    """The endpoint's side of one episode: its lock (one turn at a time), its replies, how its harness ended."""

    ep: Episode
    lock: threading.Lock = field(default_factory=threading.Lock)
    replies: dict[str, str] = field(default_factory=dict)  # a reply message (as JSON) -> the text its turn sampled
    running: bool = True  # its harness has not returned or raised
    closed: bool = False  # the harness returned, raised or timed out: later requests get 410
    checked: int = 0  # samples whose tokenization was checked before the harness edited their messages
    failure: BaseException | None = None  # the sampler's error, raised by the rollout
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)  # what the harness returned
    requests: list[list[dict]] = field(default_factory=list)  # each request's messages, converted
    bodies: list[dict] = field(default_factory=list)  # each request's reply
    called: bool = False  # its last reply called a tool: the next request brings the results, a branch point
    replay: tuple = ((), ())  # a branch's: the requests of the path it branched from, to its own first, and the replies
    stop: typing.Callable = lambda: None  # ends its harness's process (its group), where it has one


class AgentEnv(MultiTurnToolEnv):
    """Episodes run by a harness, `fn(row, base_url)`, that calls an OpenAI-compatible endpoint with its own loop and
    tools. Each request is one assistant turn of the same environment: `next_prompt` renders the request's messages
    (extend, REALIGN or fork: a harness that edits its history forks, counted), the run's sampler samples, `step`
    records the sampled ids (I1) and parses them; the reply is the parsed message. The harness's return value is the
    episode's `agent_result` column for the reward functions."""

    def __init__(self, tokenizer, agent, cfg: Config):
        super().__init__(tokenizer, [], cfg)
        self.agent = agent
        self.counts = collections.Counter()  # agent/* metrics since the last stats()
        self.count_lock = threading.Lock()
        self.workers = None  # agent_processes: the worker processes, started on the first rollout
        if cfg.agent_processes:
            self.workers = HarnessWorkers(cfg.agent, cfg.agent_processes)

    def launch(self, state: AgentEpisode, url: str):
        """An episode's harness: in a worker process (agent_processes), in a process of its own (agent_command), or in
        a thread of the trainer."""
        if self.workers:
            self.workers.submit(state, url)
            return
        fn = self.agent
        if self.cfg.agent_command:
            fn = functools.partial(run_command, shlex.split(self.cfg.agent_command), state)
        threading.Thread(target=run_harness, args=(fn, state, url), daemon=True).start()

    def close(self):
        if self.workers:
            self.workers.close()

    def count(self, key: str, n: int = 1):
        with self.count_lock:
            self.counts[key] += n

    def stats(self) -> dict:
        """The agent/* metrics since the last call, logged with the step's."""
        with self.count_lock:
            out = {f"agent/{k}": v for k, v in self.counts.items()}
            self.counts.clear()
        return out

    def rollout(
        self, rows: list[dict], sampler, generator=None, eval_temperature: float | None = None
    ) -> list[Episode]:
        """Every row's harness at once, each in a thread of its own, against an endpoint that lives for this rollout.
        A harness that raises ends `agent_error`, one that runs past agent_timeout `agent_timeout`: in training such
        an episode is left out of its group (its tokens untrained, its reward in no baseline), counted and said; an
        eval keeps it, with that end_reason."""
        evaluating = eval_temperature is not None
        temperature = self.cfg.temperature
        if evaluating:  # one path a row, at the eval's temperature
            temperature = eval_temperature
        branching = self.cfg.branch_width > 1 and not evaluating
        endpoint = AgentEndpoint(self, sampler, generator, temperature, branching)
        try:
            for i, row in enumerate(rows):
                ep = Episode(row=dict(row), messages=[], n_prompt_messages=0, group=i // roots_per_prompt(self.cfg))
                ep.node = (i,)
                ep.session = next(SESSIONS)
                endpoint.start(AgentEpisode(ep))
            states = self.wait_for_harnesses(endpoint)
        finally:
            for state in list(endpoint.states.values()):  # a harness still running (agent_timeout) ends with its group
                if state.running:
                    state.stop()
            endpoint.close()
        failure = next((s.failure for s in states if s.failure), None)
        if failure:
            raise failure  # the sampler failed (a server down): the run stops, as the built-in rollout does
        for state in states:
            view = dataclasses.replace(state.ep, samples=state.ep.samples[state.checked :])
            state.ep.tokenization_mismatches += self.chat.check_tokenization(view)
        eps = [state.ep for state in states if state.ep.end_reason != "replay_diverged"]
        if len(eps) < len(states):
            self.count("replays_dropped", len(states) - len(eps))
        eps.sort(key=lambda ep: ep.node)  # a group's episodes together, each path after the one it branched from
        faults = ("agent_error", "agent_timeout")
        faulted = [ep for ep in eps if ep.end_reason in faults]
        for ep in faulted:
            self.count(ep.end_reason + "s")
        if faulted and not evaluating:
            first = faulted[0]
            the_first = f"the first ({first.end_reason}): {first.row.get('agent_result')}"
            if len(faulted) == len(eps):
                raise HarnessFailed(
                    f"all {len(eps)} agent episodes of this rollout failed, so there is nothing to train on; {the_first}"
                )
            print(
                f"[mt-grpo] {len(faulted)} of {len(eps)} agent episodes failed and are left out of training; {the_first}",
                flush=True,
            )
            eps = [ep for ep in eps if ep.end_reason not in faults]
        return eps

    def wait_for_harnesses(self, endpoint) -> list[AgentEpisode]:
        """Each harness's return value as its row's agent_result; a raise or a timeout ends its episode as one. The
        branches a harness's episode makes while it runs are waited for too. Returns every episode's state."""
        deadline = time.monotonic() + self.cfg.agent_timeout
        done = 0
        while done < len(endpoint.states):
            for state in list(endpoint.states.values())[done:]:
                done += 1
                self.finish(state, deadline)
        return list(endpoint.states.values())

    def finish(self, state: AgentEpisode, deadline: float):
        ep = state.ep
        end = ""
        done, _ = concurrent.futures.wait([state.result], timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            end = "agent_timeout"
            ep.row["agent_result"] = f"the harness did not return within agent_timeout={self.cfg.agent_timeout}s"
        elif state.result.exception():  # its own error, a TimeoutError of its own too: the episode's outcome (I6)
            end = "agent_error"
            e = state.result.exception()
            ep.row["agent_result"] = f"{type(e).__name__}: {e}"
            if isinstance(e, HarnessFailed):  # said by a harness's process, which names its own error
                ep.row["agent_result"] = str(e)
        else:
            ep.row["agent_result"] = state.result.result()
        with state.lock:  # waits for a turn in flight
            state.closed = True
            trainer_ended = ep.done and ep.end_reason in TRAINER_ENDS  # the harness may fail on the 410 after it
            if not ep.turns and not end and not trainer_ended:
                end = "agent_error"
                ep.row["agent_result"] = "the harness returned without sending a request"
            if end and not trainer_ended:
                ep.end_reason = end
            elif not ep.end_reason:
                ep.end_reason = "agent_returned"  # after a turn that called tools: the harness stopped
            ep.done = True

    def turn(self, state: AgentEpisode, body: dict, endpoint) -> dict:
        """One request: the episode's messages become the request's, then the environment's turn."""
        from jinja2 import TemplateError

        ep = state.ep
        if state.closed or ep.done and ep.end_reason in TRAINER_ENDS:
            raise AgentError(410, f"this episode has ended ({ep.end_reason or 'the harness returned'})")
        with served_types():
            budget = self.request_budget(body)
            messages = self.messages_from(body)
        replayed = self.replay_or_branch(state, messages, endpoint)
        if replayed:
            return replayed
        before = {k: getattr(ep, k) for k in REQUEST_SETS}  # given back if the template refuses the request
        edited = ep.messages and messages[: len(ep.messages)] != ep.messages
        if edited:  # the harness changed what it was sent: check the samples so far against it, as they were sampled
            view = dataclasses.replace(ep, samples=ep.samples[state.checked :])
            ep.tokenization_mismatches += self.chat.check_tokenization(view)
            state.checked = len(ep.samples)
            self.count("history_edits")
        ep.rewritten = bool(edited)
        ep.messages = list(messages)  # step appends the reply; the request stays as it came
        if not ep.turns:
            ep.n_prompt_messages = len(messages)
        ep.sampled_texts = {}
        for i, m in enumerate(messages):
            key = json.dumps(m, sort_keys=True)
            if key in state.replies:  # a reply the harness sent back as it got it
                ep.sampled_texts[i] = state.replies[key]
        ep.done = False
        ep.end_reason = ""
        mark = ep.mark()
        try:
            prompt = self.next_prompt(ep)
        except TemplateError as e:  # e.g. roles that must alternate: the harness's messages, not the trainer
            ep.undo(mark)
            ep.__dict__.update(before)
            raise AgentError(400, f"messages: the model's chat template refuses them: {e}", "messages") from None
        budget = min(budget, endpoint.room - len(prompt))
        if budget < 1:
            ep.undo(mark)
            ep.done = True
            ep.end_reason = "context"
            raise AgentError(
                400,
                f"the conversation ({len(prompt)} tokens) leaves no room to sample under "
                f"max_seq_len={self.cfg.max_seq_len}",
                "messages",
            )
        c = endpoint.batcher.sample(prompt, budget, ep.session)
        calls = self.step(ep, c)  # the calls the harness runs; past max_env_steps none, and the episode ends
        ep.tool_calls += len(calls)
        state.called = bool(calls)
        reply = ep.messages[-1]
        state.replies[json.dumps(reply, sort_keys=True)] = ep.sampled_texts[len(ep.messages) - 1]
        state.bodies.append(completion_body(ep, reply, c, len(prompt)))
        return state.bodies[-1]

    def replay_or_branch(self, state: AgentEpisode, messages: list[dict], endpoint) -> dict | None:
        """A branch replays the path it branched from: those requests get the recorded replies (returned), and one that
        differs drops the branch. At a branch point (a request that brings tool results) the episode branches."""
        ep = state.ep
        k = len(state.requests)  # this request's index
        state.requests.append(messages)
        recorded, replies = state.replay
        if k < len(recorded) and messages != recorded[k]:
            ep.done = True
            ep.end_reason = "replay_diverged"
            raise AgentError(
                410,
                "this branch's harness sent another request than the path it branched from (a tool "
                "that is not deterministic?): the branch is dropped",
            )
        if k < len(replies):
            state.bodies.append(replies[k])
            return replies[k]
        if endpoint.branching and state.called and k >= len(recorded) and len(ep.node) <= self.cfg.branch_depth:
            for clone in self.branch(ep):  # from the tokens before this request: its tool results are the branch's
                replay = (list(state.requests), list(state.bodies))
                endpoint.start(AgentEpisode(clone, replies=dict(state.replies), checked=state.checked, replay=replay))
        return None

    def request_budget(self, body: dict) -> int:
        """The request's sampling fields against the trainer's (REFUSED, OVERRIDDEN): its max_tokens, capped."""
        if body.get("model") != AGENT_MODEL:
            raise AgentError(
                400,
                f"model: this endpoint serves {AGENT_MODEL!r}, the policy in training; got {body.get('model')!r}",
                "model",
            )
        for name, (allowed, why) in REFUSED.items():
            if body.get(name, allowed) not in (allowed, None):
                raise AgentError(400, f"{name}={body[name]!r} is not served: {why}", name)
        if body.get("tool_choice", "auto") not in ("auto", None):
            raise AgentError(400, "tool_choice: only 'auto'; the policy decides whether to call a tool", "tool_choice")
        if body.get("response_format", {"type": "text"}) not in ({"type": "text"}, None):
            raise AgentError(400, "response_format: only text; sampling is not constrained", "response_format")
        for name in OVERRIDDEN:
            if body.get(name) is not None and body[name] != getattr(self.cfg, name):
                self.count(f"overridden_{name}")
        self.set_tools(body.get("tools"))
        for name in ("max_completion_tokens", "max_tokens"):
            check_token_cap(body, name)
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or self.cfg.max_tokens
        return min(asked, self.cfg.max_tokens)

    def set_tools(self, tools):
        """The request's tool schemas for the chat template: one list for the run (the template renders every
        episode with it), and only with the native format (XML describes its tools in the system prompt)."""
        if not tools:
            return
        if self.cfg.tool_format != "native":
            raise AgentError(
                400,
                "tools: tool_format xml describes tools in the system prompt; send them there, "
                "or set tool_format: native",
                "tools",
            )
        with self.count_lock:
            if self.fmt.schemas is None:
                self.fmt.schemas = tools
        if tools != self.fmt.schemas:
            raise AgentError(
                400, "tools: differ from the first request's; this endpoint renders one tool list a run", "tools"
            )

    def messages_from(self, body: dict) -> list[dict]:
        """OpenAI chat messages -> the tool format's messages, as the environment's own turns write them."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise AgentError(400, "messages: a non-empty list of chat messages is required", "messages")
        out = []
        for m in messages:
            role = m.get("role") if isinstance(m, dict) else None
            content = m.get("content") or "" if role else ""
            if isinstance(content, list):  # content parts: text only
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    raise AgentError(400, "messages: only text content parts are served", "messages")
                content = "".join(p["text"] for p in content)
            if role not in ("system", "developer", "user", "assistant", "tool") or not isinstance(content, str):
                raise AgentError(
                    400,
                    f"messages: a message of role {role!r} with text content is not served "
                    "(roles: system, developer, user, assistant, tool)",
                    "messages",
                )
            if role == "developer":  # the system message, as newer OpenAI models name it
                role = "system"
            msg = {"role": role, "content": self.chat.norm(content)}
            if role == "tool":
                msg = self.fmt.result(msg["content"])
            calls = m.get("tool_calls") if role == "assistant" else None
            if calls:
                msg["tool_calls"] = [tool_call_from(c) for c in calls]
            out.append(msg)
        return out


def check_token_cap(body: dict, name: str):
    asked = body.get(name)
    if asked is not None and (type(asked) is not int or asked < 1):
        raise AgentError(400, f"{name}: a positive integer is required, got {asked!r}", name)


@contextlib.contextmanager
def served_types():
    """Reading a request: a field of another type than served (a string for a list, a list for an object) is the
    harness's 400, not a failure of the trainer that stops the run."""
    try:
        yield
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        raise AgentError(400, f"the request has a field of another type than served: {type(e).__name__}: {e}") from None


def tool_call_from(call) -> dict:
    """An OpenAI tool call (its arguments a JSON string) -> the template's (its arguments a dict)."""
    try:
        function = call["function"]
        args = function.get("arguments") or "{}"
        if isinstance(args, str):
            args = json.loads(args)
        return {"type": "function", "function": {"name": function["name"], "arguments": args}}
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise AgentError(
            400, f"messages: a tool call must be {{'function': {{'name', 'arguments'}}}}: {e}", "messages"
        ) from None


def completion_body(ep: Episode, reply: dict, c: Completion, prompt_tokens: int) -> dict:
    """The OpenAI chat completion of one sampled turn: its tool calls as tool_calls (arguments as JSON strings). A turn
    cut by max_tokens is `length` with no tool_calls, whole calls in it too: the trainer ended the episode truncated,
    so no harness runs a tool whose result the trainer will not take."""
    message = {"role": "assistant", "content": reply["content"]}
    finish = "stop"
    calls = reply.get("tool_calls")
    if c.finish_reason == "length":
        finish = "length"
        calls = None
    if calls:
        message["tool_calls"] = []
        for k, call in enumerate(calls):
            function = {"name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])}
            message["tool_calls"].append({"id": f"call_{len(ep.turns)}_{k}", "type": "function", "function": function})
        finish = "tool_calls"
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(c.ids)}
    usage["total_tokens"] = prompt_tokens + len(c.ids)
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    return {
        "id": f"chatcmpl-{ep.session}-{len(ep.turns)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": AGENT_MODEL,
        "choices": [choice],
        "usage": usage,
    }


# The Responses API (POST .../v1/responses) is the same turn: its request becomes a chat completions request, and the
# chat completion its Response. Its own fields, decided one by one (docs/agents.md); those not named are ignored.
RESPONSES_REFUSED = {
    "previous_response_id": "this endpoint stores no responses; send the whole conversation as input",
    "conversation": "this endpoint stores no conversations; send the whole conversation as input",
    "prompt": "this endpoint stores no prompts; send instructions and input",
    "background": "each request is one turn, answered once it is sampled",
}
RESPONSES_FIELDS = ("model", "temperature", "top_p", "tool_choice", "stream", "top_logprobs", "parallel_tool_calls")


def chat_request(body: dict) -> dict:
    """A Responses API request -> the chat completions request of the same turn: `instructions` the system message,
    `input` the messages, its function tools the chat tools, `max_output_tokens` the cap; the sampling fields as they
    are, for the same checks. Whether and how long the policy thinks is the recipe's: `reasoning` is ignored."""
    for name, why in RESPONSES_REFUSED.items():
        if body.get(name):
            raise AgentError(400, f"{name} is not served: {why}", name)
    out = {name: body[name] for name in RESPONSES_FIELDS if name in body}
    out["messages"] = messages_from_input(body.get("instructions"), body.get("input"))
    if body.get("tools"):
        out["tools"] = [chat_tool(tool) for tool in body["tools"]]
    check_token_cap(body, "max_output_tokens")
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    if (body.get("text") or {}).get("format", {"type": "text"}) not in ({"type": "text"}, None):
        raise AgentError(400, "text.format: only text; sampling is not constrained", "text")
    if "message.output_text.logprobs" in (body.get("include") or ()):
        why = REFUSED["logprobs"][1]
        raise AgentError(400, f"include: message.output_text.logprobs is not served: {why}", "include")
    return out


def chat_tool(tool) -> dict:
    """A Responses function tool (name, description, parameters, strict at its top) -> a chat completions tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else tool
        raise AgentError(400, f"tools: only function tools with a name are served, got {kind!r}", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def messages_from_input(instructions, items) -> list[dict]:
    """The Responses API's input items -> chat messages. A message's text parts are joined; each function_call joins
    the assistant message before it, as its tool_calls (a turn that only called tools has no message item); a
    function_call_output is a tool message. Reasoning items are left out: this endpoint returns none (the sampled
    thinking stays in the message's text, verbatim, so a reply sent back is the turn it was)."""
    messages = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise AgentError(400, "input: a string or a non-empty list of input items is required", "input")
    for item in items:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": input_text(item.get("content"))})
        elif kind == "function_call":
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            function = {"name": item.get("name"), "arguments": item.get("arguments")}
            call = {"id": item.get("call_id"), "type": "function", "function": function}
            messages[-1]["tool_calls"] = messages[-1].get("tool_calls", []) + [call]
        elif kind == "function_call_output":
            output = input_text(item.get("output"))
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": output})
        elif kind != "reasoning":
            raise AgentError(
                400,
                f"input: an item of type {kind!r} is not served "
                "(types: message, function_call, function_call_output, reasoning)",
                "input",
            )
    return messages


def input_text(content):
    """A Responses message's or tool output's content: a string, or text parts (input_text, output_text) joined."""
    if not isinstance(content, list):
        return content
    if any(not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text") for p in content):
        raise AgentError(400, "input: only text content parts (input_text, output_text) are served", "input")
    return "".join(p["text"] for p in content)


def response_body(completion: dict, request: dict) -> dict:
    """The chat completion of a turn as the Responses API's Response: its text an output_text message (none when the
    turn only called tools), each tool call a function_call item; a turn cut at max_tokens is incomplete."""
    from openai.types.responses import Response

    choice = completion["choices"][0]
    message = choice["message"]
    key = completion["id"].removeprefix("chatcmpl-")
    status = "completed"
    if choice["finish_reason"] == "length":
        status = "incomplete"
    output = []
    if message["content"] or not message.get("tool_calls"):
        text = {"type": "output_text", "text": message["content"], "annotations": []}
        output.append({"type": "message", "id": f"msg_{key}", "role": "assistant", "status": status, "content": [text]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        item = {"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"], "status": status}
        output.append({**item, "name": function["name"], "arguments": function["arguments"]})
    usage = completion["usage"]
    body = {
        "id": f"resp_{key}",
        "object": "response",
        "created_at": completion["created"],
        "model": completion["model"],
        "status": status,
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls") is not False,
        "tool_choice": "auto",
        "tools": request.get("tools") or [],
        "usage": {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"],
        },
    }
    if status == "incomplete":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return Response.model_validate(body).model_dump(mode="json", exclude_unset=True)


def response_events(response: dict) -> list[dict]:
    """A Response as the Responses API's stream: created, in progress, each output item added, its text or arguments
    (one delta each), done, then completed or incomplete; each event numbered, and checked against the openai
    package's `ResponseStreamEvent`."""
    started = {k: v for k, v in response.items() if k not in ("usage", "incomplete_details")}
    started = {**started, "status": "in_progress", "output": []}
    events = [{"type": "response.created", "response": started}, {"type": "response.in_progress", "response": started}]
    for i, item in enumerate(response["output"]):
        at = {"output_index": i, "item_id": item["id"]}
        added = {"type": "response.output_item.added", "output_index": i}
        if item["type"] == "message":
            part = item["content"][0]
            text = {**at, "content_index": 0, "logprobs": []}
            events += [
                {**added, "item": {**item, "status": "in_progress", "content": []}},
                {"type": "response.content_part.added", **at, "content_index": 0, "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", **text, "delta": part["text"]},
                {"type": "response.output_text.done", **text, "text": part["text"]},
                {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
            ]
        else:  # a function call
            events += [
                {**added, "item": {**item, "status": "in_progress", "arguments": ""}},
                {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                {"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]},
            ]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": f"response.{response['status']}", "response": response})
    for n, event in enumerate(events):
        event["sequence_number"] = n
        if "response" not in event:  # the Response was checked whole (`response_body`); checking it again costs ~4 ms
            response_event_type().validate_python(event)
    return events


@functools.cache
def response_event_type():
    """The openai package's `ResponseStreamEvent`, as pydantic checks it (built once: it is a union of ~100 types)."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    return pydantic.TypeAdapter(ResponseStreamEvent)


def completion_chunks(body: dict, include_usage: bool) -> list[dict]:
    """A chat completion as the `chat.completion.chunk`s of a stream (the turn is sampled whole, then sent): the role
    and the text, the tool calls, the finish reason, then the usage where `stream_options.include_usage` asks."""
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    from openai.types.chat.chat_completion_chunk import ChoiceDelta

    done = ChatCompletion.model_validate(body)
    message = done.choices[0].message
    deltas = [{"role": "assistant", "content": message.content}]
    if message.tool_calls:
        deltas.append({"tool_calls": [{"index": k, **c.model_dump()} for k, c in enumerate(message.tool_calls)]})
    choices = [{"index": 0, "delta": ChoiceDelta.model_validate(d)} for d in deltas]
    choices.append({"index": 0, "delta": ChoiceDelta(), "finish_reason": done.choices[0].finish_reason})
    head = dict(id=done.id, created=done.created, model=done.model, object="chat.completion.chunk")
    chunks = [ChatCompletionChunk(**head, choices=[choice]) for choice in choices]
    if include_usage:
        chunks.append(ChatCompletionChunk(**head, choices=[], usage=done.usage))
    return [chunk.model_dump(mode="json", exclude_none=True) for chunk in chunks]


def server_sent(events: list[dict], named: bool) -> list[str]:
    """Server-sent events: each `data: <json>`, under `event: <its type>` where named (the Responses API's), or
    closed by `data: [DONE]` (chat completions')."""
    out = []
    for event in events:
        name = ""
        if named:
            name = f"event: {event['type']}\n"
        out.append(f"{name}data: {json.dumps(event)}\n\n")
    if not named:
        out.append("data: [DONE]\n\n")
    return out


def run_harness(agent, state: AgentEpisode, url: str):
    try:
        state.result.set_result(agent(copy.deepcopy(state.ep.row), url))
    except BaseException as e:  # noqa: BLE001 - handed to the rollout
        state.result.set_exception(e)
    finally:
        state.running = False


# Harnesses in processes of their own: a command per episode (agent_command), or harness functions in worker processes
# (agent_processes). Each process starts a session of its own, so its process group holds whatever it starts, and the
# group ends with it: what a harness leaves running (a server, a browser, a sandbox) goes with its episode.


class HarnessFailed(RuntimeError):
    """A harness's error as its process said it (`ValueError: ...`, an exit status and the end of its stderr)."""


class HarnessProcess:
    """A process in a session of its own. `wait` waits for it to exit, ends its group (what it left running) and
    reaps it; `end` kills the group now. The group is signalled only before the process is reaped, while its id
    cannot be another group's."""

    def __init__(self, argv: list[str], **kw):
        self.proc = subprocess.Popen(argv, start_new_session=True, **kw)
        self.lock = threading.Lock()
        self.code = None  # its exit status, once reaped
        self.ended = False  # its group was killed, or it exited
        self.pending = {}  # a worker's (HarnessWorkers) episodes in flight, by key

    def end(self):
        with self.lock:
            self.ended = True
            if self.code is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)

    def wait(self) -> int:
        os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not yet reaped
        self.end()
        with self.lock:
            self.code = self.proc.wait()
        return self.code


def run_command(argv: list[str], state: AgentEpisode, row: dict, url: str) -> str:
    """An agent_command episode: the row as JSON on its stdin, its base_url as OPENAI_BASE_URL (and an
    OPENAI_API_KEY, which clients require); what it prints, stripped, is its agent_result. Its output goes to files,
    so nothing it leaves running can hold a pipe open."""
    env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": "mt-grpo"}
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdin.write(json.dumps(row, default=str).encode())
        stdin.seek(0)
        process = HarnessProcess(argv, stdin=stdin, stdout=out, stderr=err, env=env)
        state.stop = process.end
        if state.closed:  # its episode ended (agent_timeout) before it started
            process.end()
        code = process.wait()
        out.seek(0)
        err.seek(0)
        said = err.read().decode(errors="replace").strip()[-2000:]
        if code:
            how = f"exited with status {code}"
            if code < 0:
                how = f"was killed by signal {-code}"
            raise HarnessFailed(f"agent_command `{shlex.join(argv)}` {how}: {said or '(nothing on stderr)'}")
        return out.read().decode(errors="replace").strip()


def agent_worker(spec: str):
    """A worker process (agent_processes), started as `python -c` with this function's source, so it imports nothing
    of the trainer: loads the harness `file.py:fn`, reads episodes as JSON lines on stdin ({key, row, url}), runs each
    in a thread of its own, and writes each outcome as a JSON line ({key, result} or {key, error}) to what was its
    stdout. What the harness prints goes to stderr."""
    import importlib.util
    import json
    import os
    import sys
    import threading

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the harness prints, as it imports too, and what it starts
    sys.stdout = sys.stderr
    path, name = spec.rsplit(":", 1)
    sys.path.insert(0, os.path.dirname(path))  # its siblings import, as in the trainer
    module_spec = importlib.util.spec_from_file_location("mtgrpo_harness", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    harness = getattr(module, name)
    lock = threading.Lock()

    def run(task):
        try:
            line = json.dumps({"key": task["key"], "result": harness(task["row"], task["url"])})
        except BaseException as e:  # noqa: BLE001 - the episode's outcome; an unsendable result is one too
            line = json.dumps({"key": task["key"], "error": f"{type(e).__name__}: {e}"})
        with lock:
            out.write(line + "\n")
            out.flush()

    for line in sys.stdin:
        threading.Thread(target=run, args=(json.loads(line),), daemon=True).start()


AGENT_WORKER = inspect.getsource(agent_worker)  # read now: a worker started later runs this, if the file changed since


class HarnessWorkers:
    """agent_processes worker processes (`agent_worker`), started as episodes need them: each episode goes to the
    worker with the fewest, and runs in a thread of it. A worker that ends (killed with a hung harness's episode, or
    crashed) fails the episodes it held; the next episode starts a new one."""

    def __init__(self, spec: str, n: int):
        full, name = plugin_file(spec, "agent")
        target = f"{os.path.abspath(full)}:{name}"
        self.argv = [sys.executable, "-c", f"{AGENT_WORKER}\nagent_worker({target!r})"]
        self.n = n
        self.workers = []  # the living: each a HarnessProcess with its episodes in flight, by key (`pending`)
        self.keys = itertools.count()
        self.lock = threading.Lock()

    def submit(self, state: AgentEpisode, url: str):
        key = str(next(self.keys))
        line = json.dumps({"key": key, "row": state.ep.row, "url": url}, default=str) + "\n"
        with self.lock:
            self.workers = [w for w in self.workers if not w.ended]  # one ended with a hung episode is replaced
            if len(self.workers) < self.n:
                worker = HarnessProcess(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                threading.Thread(target=self.read, args=(worker,), daemon=True).start()
                self.workers.append(worker)
            worker = min(self.workers, key=lambda w: len(w.pending))
            worker.pending[key] = state
            state.stop = worker.end
            try:
                worker.proc.stdin.write(line)
                worker.proc.stdin.flush()
            except OSError:  # it ended: read() fails what it held, this episode too
                pass

    def read(self, worker: HarnessProcess):
        for line in worker.proc.stdout:
            outcome = json.loads(line)
            with self.lock:
                state = worker.pending.pop(outcome["key"])
            if "error" in outcome:
                state.result.set_exception(HarnessFailed(outcome["error"]))
            else:
                state.result.set_result(outcome["result"])
            state.running = False
        code = worker.wait()
        with self.lock:
            held = list(worker.pending.values())
            worker.pending.clear()
        for state in held:
            state.result.set_exception(HarnessFailed(f"its worker process (agent_processes) ended with status {code}"))
            state.running = False

    def close(self):
        with self.lock:
            workers = list(self.workers)
        for worker in workers:
            worker.end()


class SamplingQueue:
    """The episodes' requests, sampled together: a thread collects requests until every running harness has sent one,
    or none came for BATCH_WINDOW, and calls the sampler once for them (the in-process sampler decodes a batch; a
    server batches them too). A harness busy with its own tools is not waited for longer than that."""

    def __init__(self, sampler, generator, temperature: float, top_p: float, stop, running):
        self.sampler = sampler
        self.running = running  # -> how many harnesses are still running
        self.kw = dict(temperature=temperature, top_p=top_p, stop=stop, generator=generator)
        self.requests = queue.SimpleQueue()
        self.thread = threading.Thread(target=self.work, daemon=True, name="agent-sampling")
        self.thread.start()

    def sample(self, prompt: list[int], budget: int, session: int) -> Completion:
        fut = concurrent.futures.Future()
        self.requests.put((prompt, budget, session, fut))
        return fut.result()

    def work(self):
        while True:
            batch = [self.requests.get()]
            while batch[-1] is not None and len(batch) < self.running():
                try:
                    batch.append(self.requests.get(timeout=BATCH_WINDOW))
                except queue.Empty:
                    break
            stopping = batch[-1] is None
            batch = [b for b in batch if b is not None]
            if batch:
                self.generate(batch)
            if stopping:
                return

    def generate(self, batch: list):
        prompts, budgets, sessions, futures = zip(*batch)
        try:
            outs = self.sampler.generate(list(prompts), list(budgets), sessions=list(sessions), **self.kw)
        except BaseException as e:  # noqa: BLE001 - each request's turn raises it
            for fut in futures:
                fut.set_exception(e)
            return
        for fut, c in zip(futures, outs):
            fut.set_result(c)

    def close(self):
        self.requests.put(None)
        self.thread.join(timeout=60)


class AgentEndpoint:
    """127.0.0.1 on a free port, for one rollout: each episode's base_url, /episodes/<key>/v1, serves ROUTES (a chat
    completion or a Response, each whole or streamed, and the models). An unknown episode or route gets 404, an episode whose harness
    ended 410, a bad request 400 naming its field. Requests of one episode take its lock, one turn at a time (a concurrent one is counted)."""

    def __init__(self, env: AgentEnv, sampler, generator, temperature: float, branching: bool):
        import http.server

        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            wbufsize = 1 << 16  # a reply's headers and body in one write: each write waits for the interpreter lock
            disable_nagle_algorithm = True  # a longer body goes in several writes: Nagle would hold one for an ACK

            def setup(self):
                super().setup()
                endpoint.connections.add(self.connection)  # a keep-alive connection, closed with the endpoint

            def finish(self):
                super().finish()
                endpoint.connections.discard(self.connection)

            def do_GET(self):
                endpoint.handle(self, None)

            def do_POST(self):
                endpoint.handle(self, self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def log_message(self, *args):
                pass

        self.env = env
        self.connections = set()  # the harnesses' open connections: a client kept alive would hold a thread each
        self.states = {}  # URL key -> an episode's state, in the order started (branches after their root)
        self.lock = threading.Lock()
        self.branching = branching  # branch_width > 1, in training: a harness's episode branches as a built-in one
        self.room = min(env.cfg.max_seq_len, getattr(sampler, "max_model_len", math.inf))
        running = lambda: sum(state.running for state in list(self.states.values()))  # noqa: E731
        self.batcher = SamplingQueue(sampler, generator, temperature, env.cfg.top_p, env.stop, running)

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 1024  # every episode's harness may connect at once

        self.server = Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="agent-endpoint")
        self.thread.start()

    def start(self, state: AgentEpisode):
        """The episode's harness, in a thread of its own, at a URL of its own."""
        with self.lock:
            key = f"e{len(self.states)}"
            self.states[key] = state
        url = f"http://127.0.0.1:{self.server.server_port}/episodes/{key}/v1"
        self.env.launch(state, url)

    def handle(self, handler, raw: bytes | None):
        try:
            status, body = 200, self.answer(handler.path, raw)
        except AgentError as e:
            kind = ERROR_TYPES[e.status]
            status, body = e.status, {"error": {"message": str(e), "type": kind, "param": e.param, "code": None}}
        kind = "application/json"
        data = json.dumps(body).encode()
        if isinstance(body, list):  # server-sent events, whole: a Content-Length body of events is a valid stream
            kind = "text/event-stream"
            data = "".join(body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", kind)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def answer(self, path: str, raw: bytes | None) -> dict | list[str]:
        """A JSON body, or a stream's server-sent events."""
        hit = re.fullmatch(r"/episodes/([^/]+)/v1/(.*)", path.split("?")[0])
        state = self.states.get(hit.group(1)) if hit else None
        if state is None:
            raise AgentError(404, f"no episode at {path}: each harness gets its own base_url")
        route = (("POST" if raw is not None else "GET"), hit.group(2))
        if route not in ROUTES:
            served = ", ".join(f"{method} {name}" for method, name in ROUTES)
            raise AgentError(404, f"no route {route[0]} {path}: an episode's base_url serves {served}")
        if route[1] == "models":
            return {"object": "list", "data": [{"id": AGENT_MODEL, "object": "model", "owned_by": "mt-grpo"}]}
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            raise AgentError(400, f"the request body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise AgentError(400, "the request body must be a JSON object")
        if route[1] == "responses":
            return self.response(state, body)
        with served_types():
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        completion = self.turn(state, body)
        if not body.get("stream"):
            return completion
        return server_sent(completion_chunks(completion, include_usage), named=False)

    def response(self, state: AgentEpisode, body: dict) -> dict | list[str]:
        """A Responses API request: the chat completions request of the same turn, its reply as a Response."""
        try:
            with served_types():
                request = chat_request(body)
            completion = self.turn(state, request)
        except AgentError as e:
            if e.param == "messages":  # the messages made of instructions and input
                e.param = "input"
            raise
        response = response_body(completion, body)
        if not body.get("stream"):
            return response
        return server_sent(response_events(response), named=True)

    def turn(self, state: AgentEpisode, body: dict) -> dict:
        """The environment's turn for one request, under the episode's lock: its chat completion."""
        if not state.lock.acquire(blocking=False):  # another thread of this harness is in a turn
            self.env.count("concurrent_requests")
            state.lock.acquire()
        try:
            return self.env.turn(state, body, self)
        except AgentError:
            raise
        except BaseException as e:  # noqa: BLE001 - the sampler's error stops the run after this rollout
            state.failure = state.failure or e
            raise AgentError(500, f"the trainer failed on this turn: {type(e).__name__}: {e}") from None
        finally:
            state.lock.release()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        for connection in list(self.connections):  # their handler threads, waiting for a next request, end
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self.batcher.close()


if __name__ == "__main__":
    main()

"""The embedded default task: look a key up with a tool, then answer with its value.

Everything here is generated, so `bash run.sh` needs no download:
- `make_dataset()`: prompts with their gold value (columns `prompt`, `key`, `answer`);
- `build_model(path, system_prompt)`: a byte-level BPE tokenizer with a ChatML template and a
  2-layer Qwen3-architecture model (~0.4M parameters), then a short supervised warm-start.

The warm-start teaches the XML protocol and how a lookup works, but not when to use it: it first
trains on demonstrations that always look up, then on a mix where only a quarter call the tool (with the question's key, then answer with the
result); the rest answer "unknown" without looking. So the warm-started policy answers correctly
about a quarter of the time, and learning to look the key up first is left to the trainer's own RL
loss.
(Demonstrations that always look up but with a random key teach no question->argument copying, and
sparse RL reward alone does not build that circuit in a few minutes: we tried.)
"""

import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.kv_lookup import KEYS, TABLE, VALUES  # noqa: E402

QUESTIONS = [
    'What is the value of "{k}"?',
    'Look up "{k}" and tell me its value.',
    'Which value is stored under "{k}"?',
]
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<reasoning>", "</reasoning>", "<tool>", "</tool>", "<answer>", "</answer>", "<result>", "</result>"]
WARMSTART = dict(demonstrations=2048, steps=300, lookup_only_steps=200, batch_size=32, lr=3e-3, seed=0, p_tool=0.25)


def make_dataset(n: int = 512, seed: int = 0):
    """Rows `{prompt, key, answer}`: a question about one key of the store, and its value."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.choice(KEYS)
        rows.append({"prompt": rng.choice(QUESTIONS).format(k=k), "key": k, "answer": TABLE[k]})
    return rows


def make_eval_dataset():
    """One row per (key, question form): every prompt the task has, for greedy evaluation."""
    return [{"prompt": q.format(k=k), "key": k, "answer": TABLE[k]} for k in KEYS for q in QUESTIONS]


def demonstration(row, system_prompt, rng, p_tool=None):
    """A protocol-correct episode: with probability p_tool it looks the question's key up and answers
    with the result; otherwise it answers "unknown" at once."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    msgs.append({"role": "user", "content": row["prompt"]})
    if rng.random() >= (WARMSTART["p_tool"] if p_tool is None else p_tool):
        return msgs + [
            {"role": "assistant", "content": "<reasoning>Let me think.</reasoning>\n<answer>unknown</answer>"}
        ]
    call = json.dumps({"name": "lookup", "args": {"key": row["key"]}})
    return msgs + [
        {"role": "assistant", "content": f"<reasoning>Let me think.</reasoning>\n<tool>{call}</tool>"},
        {"role": "user", "content": f"<result>\n{row['answer']}\n</result>"},
        {
            "role": "assistant",
            "content": f"<reasoning>The result holds the value.</reasoning>\n<answer>{row['answer']}</answer>",
        },
    ]


def build_tokenizer(corpus):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=640,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.add_tokens(TAGS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    )


def assistant_mask(tokenizer, messages):
    """Token ids of the rendered conversation, and 1 on assistant tokens (content and <|im_end|>)."""
    ids, mask = [], []
    for i, m in enumerate(messages):
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        new = tokenizer.encode(upto, add_special_tokens=False)[len(ids) :]
        if m["role"] == "assistant":
            head = len(
                tokenizer.encode(
                    tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True),
                    add_special_tokens=False,
                )
            ) - len(ids)
            mask += [0] * head + [1] * (len(new) - head)
        else:
            mask += [0] * len(new)
        ids += new
    return ids, mask


def build_model(path: str, system_prompt: str = ""):
    """Create tokenizer + tiny model under `path`, warm-started on demonstrations; returns a report."""
    t0 = time.time()
    rng = random.Random(WARMSTART["seed"])
    rows = make_dataset(WARMSTART["demonstrations"], seed=WARMSTART["seed"] + 1)
    demos = [demonstration(r, system_prompt, rng) for r in rows]
    lookups = [demonstration(r, system_prompt, rng, p_tool=1.0) for r in rows]
    corpus = (
        [f"{m['role']}\n{m['content']}" for d in demos[:512] for m in d]
        + VALUES
        + KEYS
        + [json.dumps({"key": k}) for k in KEYS]
    )
    # Phase 1 (lookup_only_steps): demonstrations that always look up, so the model learns to copy
    # the key into the call and the result into the answer. Phase 2: the p_tool mix, so the policy
    # starts out skipping the tool most of the time.
    return warm_start(path, build_tokenizer(corpus), lookups, demos, WARMSTART, rng, "tasks/toy_kv.py", t0)


def warm_start(path, tok, phase1, phase2, ws, rng, builder, t0):
    """The 2-layer Qwen3-architecture model (4 heads of 32: vLLM's CPU attention rejects 16), trained on the
    phase-1 demonstrations for ws["lookup_only_steps"] steps, then on phase 2 up to ws["steps"]; saved with
    `tok` and a build_report.json under `path`. Shared by the embedded tasks' builders; returns the report.
    ws["max_positions"] (default 1024) sets the model's context length."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(ws["seed"])
    model = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tok),
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=ws.get("max_positions", 1024),
            tie_word_embeddings=True,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
        )
    )
    phase1, phase2 = [assistant_mask(tok, d) for d in phase1], [assistant_mask(tok, d) for d in phase2]
    opt = torch.optim.AdamW(model.parameters(), lr=ws["lr"], weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / ws["steps"])
    model.train()
    for step in range(ws["steps"]):
        batch = rng.sample(phase1 if step < ws["lookup_only_steps"] else phase2, ws["batch_size"])
        L = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [tok.pad_token_id] * (L - len(i)) for i, _ in batch])
        labels = torch.tensor([[t if m else -100 for t, m in zip(i, mk)] + [-100] * (L - len(i)) for i, mk in batch])
        attn = torch.tensor([[1] * len(i) + [0] * (L - len(i)) for i, _ in batch])
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    ws = {**ws, "final_loss": round(loss.item(), 4), "seconds": round(time.time() - t0, 1)}
    report = {
        "builder": builder,
        "params": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tok),
        "warmstart": ws,
        "summary": f"supervised warm-start of {ws['steps']} steps on {ws['demonstrations']} generated "
        f"demonstrations (final loss {ws['final_loss']}, {ws['seconds']} s)",
    }
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(os.path.join(path, "build_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report

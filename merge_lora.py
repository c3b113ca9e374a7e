"""merge-lora: a LoRA checkpoint's adapter merged into its base model (the folder the adapter names), written as one
plain HF model folder, for `eval`, vLLM or release.

    python mt_grpo_trainer.py merge-lora CHECKPOINT OUT_DIR      (or: bash run.sh merge-lora ...)
    python merge_lora.py CHECKPOINT OUT_DIR                       (the same)

It lives beside the trainer, not in it, because training never needs it.
"""

import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit("usage: python mt_grpo_trainer.py merge-lora CHECKPOINT OUT_DIR")
    checkpoint, out = argv
    if not os.path.isdir(checkpoint):
        sys.exit(
            f"mt-grpo: error: {checkpoint} not found; give a LoRA run's checkpoint folder, e.g. runs/NAME/checkpoint-200"
        )
    if not os.path.isfile(os.path.join(checkpoint, "adapter_config.json")):
        sys.exit(
            f"mt-grpo: error: {checkpoint} holds no LoRA adapter (adapter_config.json); a checkpoint of full "
            "fine-tuning is a model folder already"
        )
    import torch
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    AutoPeftModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).merge_and_unload().save_pretrained(out)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(out)
    print(f"[mt-grpo] {checkpoint} merged into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run by tests/test_distributed.py under torchrun (gloo, CPU): one train_on_samples update on a
fixed batch, each rank holding its share of the groups. Rank 0 writes the updated weights."""
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mt_grpo_trainer as M  # noqa: E402


def fixed_batch(vocab: int, n_groups: int = 4, group: int = 2) -> list[list[M.Sample]]:
    """Groups of samples with different lengths, masks and advantages (the same in every process)."""
    rng = random.Random(0)
    groups = []
    for _ in range(n_groups):
        g = []
        for _ in range(group):
            s = M.Sample()
            n_prompt, n_sampled = rng.randint(3, 20), rng.randint(2, 25)
            s.append([rng.randrange(vocab) for _ in range(n_prompt)], mask=0)
            s.append([rng.randrange(vocab) for _ in range(n_sampled)], mask=1,
                     logprobs=[-rng.uniform(0.5, 4) for _ in range(n_sampled)], turn=0)
            adv = rng.uniform(-1.5, 1.5)
            s.advantages = [adv * m for m in s.loss_mask]
            g.append(s)
        groups.append(g)
    return groups


def update(model_dir: str, overrides: list[str]) -> dict:
    """One optimizer step; returns the full updated state dict (complete on rank 0)."""
    from transformers import AutoModelForCausalLM
    cfg = M.load_config(None, ["learning_rate=1.0", "max_grad_norm=0", *overrides])
    rank, world, device = M.init_distributed(cfg) if ("RANK" in os.environ or cfg.fsdp) else (0, 1, torch.device("cpu"))
    model = M.add_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg)   # as load_models
    if cfg.gradient_checkpointing:   # as train() does
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    groups = fixed_batch(model.config.vocab_size)
    mine = [s for g in groups[rank::world] for s in g]   # whole groups per rank
    policy = M.wrap_model(model, cfg, device)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)   # the update is the gradient itself
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = M.train_on_samples(policy, None, opt, sched, mine, cfg, pad_id=0)
    sd, _ = M.full_state(model, None, cfg.fsdp)
    return sd, metrics


if __name__ == "__main__":
    model_dir, out = sys.argv[1], sys.argv[2]
    sd, metrics = update(model_dir, sys.argv[3:])
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"state": sd, "metrics": metrics}, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()   # as Run.close: no rank tears gloo down while another still uses it
        torch.distributed.destroy_process_group()
    M.exit_now(0)   # as main() under torchrun: no C++ teardown, where gloo's threads can abort a finished rank

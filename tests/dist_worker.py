"""Run by tests/test_distributed.py under torchrun (gloo, CPU): one train_on_samples update on a
fixed batch, each rank holding its share of the groups. Rank 0 writes the updated weights. Several
updates in one launch: override sets separated by `::`, each on a freshly loaded model."""

import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mt_grpo_trainer as M  # noqa: E402


def fixed_batch(vocab: int, n_groups: int = 4, group: int = 2) -> list[list[M.Episode]]:
    """Groups of episodes with different lengths, masks and advantages (the same in every process). A group's
    episodes share its prompt (packing holds it once). The first episode (on rank 0) forked: it has two samples."""
    rng = random.Random(0)
    groups = []
    for i in range(n_groups):
        g = []
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(3, 20))]
        for j in range(group):
            ep, adv = M.Episode(row={}, messages=[], n_prompt_messages=0), rng.uniform(-1.5, 1.5)
            for _ in range(2 if i == j == 0 else 1):
                s = M.Sample()
                n_sampled = rng.randint(2, 25)
                s.append(prompt, mask=0)
                s.append(
                    [rng.randrange(vocab) for _ in range(n_sampled)],
                    mask=1,
                    logprobs=[-rng.uniform(0.5, 4) for _ in range(n_sampled)],
                    turn=0,
                )
                s.advantages = [adv * m for m in s.loss_mask]
                ep.samples.append(s)
            g.append(ep)
        groups.append(g)
    return groups


def update(model_dir: str, overrides: list[str]) -> tuple[dict, dict]:
    """One optimizer step; returns the full updated state dict (complete on rank 0) and the step's metrics."""
    cfg = M.load_config(None, [f"model_name_or_path={model_dir}", "learning_rate=1.0", "max_grad_norm=0", *overrides])
    rank, world, device = M.init_distributed(cfg) if ("RANK" in os.environ or cfg.fsdp) else (0, 1, torch.device("cpu"))
    _, model, ref_model, policy, _, _ = M.load_models(cfg, model_dir, device)  # as a run loads them (reference too)
    groups = fixed_batch(model.config.vocab_size)
    mine, _ = M.trainable_samples([ep for g in groups[rank::world] for ep in g], cfg)  # whole groups per rank
    opt = torch.optim.SGD(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate
    )  # the update is the gradient itself
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    metrics = M.train_on_samples(policy, ref_model, opt, sched, mine, cfg, pad_id=0)
    sd, _ = M.full_state(model, None, cfg.fsdp)
    return sd, metrics


if __name__ == "__main__":
    model_dir, out = sys.argv[1], sys.argv[2]
    runs = [update(model_dir, o.split()) for o in " ".join(sys.argv[3:]).split("::")]
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save([{"state": sd, "metrics": metrics} for sd, metrics in runs], out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # as Run.close: no rank tears gloo down while another still uses it
        torch.distributed.destroy_process_group()
    M.exit_now(0)  # as main() under torchrun: no C++ teardown, where gloo's threads can abort a finished rank

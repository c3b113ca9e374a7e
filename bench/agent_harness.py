"""Does the toy task run as an agent harness learn as the built-in environment does, on the same seeds? And what does
the harness's endpoint cost per call against the built-in environment? (issue 37; appendix H of mt_grpo_trainer.py)

    .venv/bin/python bench/agent_harness.py --part overhead                 # the per-call cost, minutes
    .venv/bin/python bench/agent_harness.py --part learning                 # 12 runs of 100 steps, two at a time

Pre-registered: everything below was written and committed before any number of either part was seen.

Part `learning`
- Recipes: hf_recipes/toy/toy-kv--mt-grpo.yaml (built-in: the trainer's own loop, `tools: [tools/kv_lookup.py:lookup]`)
  and hf_recipes/toy/toy-kv-agent--mt-grpo.yaml (harness: tasks/toy_kv_agent.py's loop with the OpenAI client
  against the per-episode endpoint), which differ only in `agent`, `tools` and `output_dir`. Each run: 100 steps
  (the recipes' default) of 8 prompts x 8 episodes, the in-process sampler, `eval_steps=0` (no evaluation), and
  `save_steps=0` (only the final save, which is outside the step times; it changes nothing the run learns).
- Seeds 0-5, paired: seed s of both recipes draws the same training prompts at every step (`rows_for_step` depends
  on the seed and the step only) and seeds the sampler's generator the same way. The episodes are not expected to be
  bit-identical: the built-in environment samples every unfinished episode's turn in one batch, the harness's
  requests are batched as they arrive (SamplingQueue), so the same generator is drawn from in another order.
- Runs: bench/seed_runs.py's workers, two trainers at once, one thread each; a run that crashes is started again
  on the same seed (seed_runs does so once by itself), and the report says so. Harness episodes that raise are left
  out of training by the trainer and counted (`agent/agent_errors`, `agent/agent_timeouts`); they are reported,
  and no run is left out for them.
- Before the runs, each part is run once at a small size to check that the code runs (`--part overhead --repeats 1`,
  `--part learning --seeds 900 --steps 3`, into their own folders); none of their numbers enter anything here.

Metric and test
- Per run, the criteria of README's table for `bash run.sh`, from `reward/outcome` in metrics.jsonl
  (bench/server_vs_local.py's `curve`): the outcome reward at step 1, the means over steps 1-10 and 91-100, and the
  first step whose trailing-10 mean reaches 0.8.
- Primary statistic, per seed: d = harness minus built-in of the steps 91-100 mean. Reported: the mean of d over the
  six seeds, its 95% percentile bootstrap CI (bench/paired_stats.py's `bootstrap_ci`: resampling seeds, 10,000
  resamples, seed 0), and the two-sided exact Wilcoxon signed-rank p (zero differences dropped). paired_stats has
  only the one-sided test (`wilcoxon_greater`), so two-sided p = min(1, 2 * min(p_greater(d), p_greater(-d))).
- Decision rule, checked in this order: "learns as the built-in does" if the 95% CI lies within [-0.10, +0.10]
  (the equivalence margin; a CI inside it that also excludes 0 is still this verdict, with the small difference
  named); else "differs" if the CI excludes 0; else "undecided at this size".
- Reported beside, not tested: step 1, steps 1-10 and the step to 0.8 per seed; wall time per step of each recipe,
  split into rollout and train (`time/rollout`, `time/train`, `time/step`, means over the 100 steps; two trainers
  share the two cores, so these are times under that load), and each run's whole wall time; the agent/* counts.

Prediction: equivalent. The turns are the same code (`next_prompt`, the sampler, `step`); only the batching differs.

Part `overhead`
- The two recipes set up by the trainer's own `setup` (as bench/packing.py's `rollout` does), the in-process sampler
  on one thread. Both environments roll out with the built-in run's sampler (one model object, the same weights), on
  the same rows: seed 0's step-0 batch, 8 prompts x 8 episodes; each rollout with a fresh `run.generator(0)`.
- A rollout is `run.env.rollout(rows, sampler, generator)`. One warm-up rollout of each env (not counted), then
  K = 10 (`--repeats`) of each, alternating built-in and harness. Per rollout: its wall time, the time spent inside
  `sampler.generate` (a wrapper sums it), and the number of assistant turns (the prompts given to `generate`: one per
  request the harness made and was answered); also the number of `generate` calls (batches).
- Overhead per call, per rollout = (rollout time - generate time) / turns: for the built-in env, its loop, tool
  calls and bookkeeping; for the harness, the same plus the endpoint (HTTP, JSON both ways, the openai client, the
  thread hand-offs and SamplingQueue's batching waits). The difference: harness minus built-in of repeat k, per k.
- Two variants: `sampled` (the in-process sampler as trained), and `scripted`: a zero-cost sampler that returns
  fixed token ids at once (each episode's first turn a `lookup` tool call, its second an answer, by the request's
  session, as tests/test_env.py's ScriptedSampler scripts turns), which isolates the endpoint, HTTP and openai
  client from generation.
- Reported: ms per call, median and IQR over the K rollouts, of each env and of the difference, per variant; beside
  it the rollout seconds, generate seconds, turns and generate calls per rollout (medians).

Prediction: the harness costs more per call than the built-in environment, by milliseconds (one local HTTP round
trip and a client call per turn); no size was fixed in advance.

Output: the tables, then the learning part's comparison line last; per-run folders and results.json under
bench/runs/agent-harness/ (learning/{builtin,harness}-seedS/, overhead/).
"""

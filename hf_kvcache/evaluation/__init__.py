"""The harness: everything that measures the library, above the core in the layer contract (setup.cfg), which imports
nothing of it. One module per protocol or benchmark: perplexity, divergence, retrieval, speed, memory, host syncs,
the sweeps (`sweep*`), the RULER suite (`ruler/`), the lm-eval adapter (`lm_eval_adapter`, `tasks/`), the demo
(`demo`, `demo_report`), plots, KVzap's training (`kvzap_training`), and the serving benchmark: `serve_bench` with
`serve_workload` (its settings and requests), `serve_runner` (the interleaved runs), `agreement` (teacher-forced
logits of continuous-batching runs and what the scheduler did at each forward), `concurrency` (requests held at once
in a run's memory-bound steady state), `serve_kl` (KL of quantized pages), `serve_report` (summary, files) and
`eviction_reference` (prompt eviction through `generate`: the server's oracle). The offline model and corpus are the
core's (hf_kvcache.sharing.models, .corpus). Nothing is imported here, so importing one protocol stays light."""

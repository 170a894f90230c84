"""Evaluation harness library shared by the scripts in `eval/` and by the tests (one module per protocol, e.g.
`hf_kvcache.evaluation.streaming`). Nothing is imported here, so importing one protocol stays light."""

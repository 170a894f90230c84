# The two commands of README.md. Each does its own set-up (a .venv in the repo) on a fresh machine.
.PHONY: demo test

demo:
	bash scripts/setup-env.sh eval
	.venv/bin/hf-kvcache demo

test:
	bash scripts/setup-env.sh dev
	.venv/bin/python -m pytest -q

# The two commands of README.md. Each does its own set-up (a .venv in the repo) on a fresh machine.
.PHONY: demo test docs

demo:
	bash scripts/setup-env.sh eval
	.venv/bin/hf-kvcache demo

test:
	bash scripts/setup-env.sh dev
	.venv/bin/python -m pytest -q

docs:
	bash scripts/setup-env.sh dev
	.venv/bin/mkdocs build --strict -d site

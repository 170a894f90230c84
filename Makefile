# The two commands of README.md (`make demo`, `make test`). Each does its own set-up on a fresh machine, installing
# the exact versions of requirements/lock.txt (what CI tested) into a virtual environment in the repo.
.PHONY: demo test test-wheel test-full test-oldest test-newest-torch test-latest lock docs

demo:
	bash scripts/setup-env.sh eval
	.venv/bin/hf-kvcache demo

# The package as users get it (the wheel built and used from a bare environment), the whole suite on the lock (the
# newest supported transformers, the oldest supported torch), then the contract and smoke tests on the oldest
# supported transformers and on the newest supported torch: both ends of each declared range. CI runs `make demo`,
# then this.
test: test-wheel test-full test-oldest test-newest-torch

test-wheel:
	bash scripts/setup-env.sh dev
	bash scripts/check-wheel.sh

test-full:
	bash scripts/setup-env.sh dev
	.venv/bin/python -m pytest -q

test-oldest:
	bash scripts/setup-env.sh dev .venv-oldest oldest
	.venv-oldest/bin/python -m pytest -q -m upstream

test-newest-torch:
	bash scripts/setup-env.sh dev .venv-torch-newest newest-torch
	.venv-torch-newest/bin/python -m pytest -q -m upstream

# The canary: the newest releases of everything (transformers' newest even past our declared range), the contract
# tests and a smoke of every cache. How a version bump starts (docs/upstream_contracts.md). TORCH=2.16.0 canaries a
# torch release too (its PyPI wheel pulls the CUDA libraries, several GB).
test-latest:
	HF_KVCACHE_TORCH=$(or $(TORCH),2.13.0) bash scripts/setup-env.sh dev .venv-latest latest
	.venv-latest/bin/python -m pytest -q -m upstream

# Pin what the suite just passed with in .venv (run after `make test` on a new set of versions).
lock:
	bash scripts/lock.sh .venv

docs:
	bash scripts/setup-env.sh dev
	.venv/bin/mkdocs build --strict -d site

"""Write this folder's cache state files with the installed transformers (run once per supported minor, from the
repo root: `.venv-oldest/bin/python tests/data/state_across_versions/make_fixtures.py`, then with `.venv`).

The tiny hybrid model (a sliding-window layer, transformers' own DynamicSlidingWindowLayer, then a full-attention
layer, ours) is saved once in model/ so every version loads the same weights; each cache of CASES is prefilled
as tests/test_state.py does and saved as state-<case>-<transformers minor>.safetensors.
tests/test_state_across_versions.py loads every file on the running version and resumes it.
"""

import pathlib
import sys

import transformers

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/: conftest and test_state

from test_state import _prefix  # noqa: E402
from test_state_across_versions import CASES, fixture_model, minor  # noqa: E402

import hf_kvcache  # noqa: E402

if __name__ == "__main__":
    model = fixture_model()
    for name, make in CASES.items():
        cache = make(model)
        _prefix(model, cache)
        path = HERE / f"state-{name}-{minor(transformers.__version__)}.safetensors"
        hf_kvcache.save_cache_state(cache, path)
        print("wrote", path.name, path.stat().st_size, "bytes")

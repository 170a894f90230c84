"""Print the tables of transformers internals hf_kvcache relies on and of the attributes it patches, for
docs/upstream_contracts.md (which tests/test_upstream_contracts.py and tests/test_patches.py check against the
registries)."""

import hf_kvcache  # noqa: F401  (imports every contract and patch)
from hf_kvcache.integration import patches
from hf_kvcache.integration.contracts import markdown_table

if __name__ == "__main__":
    print(markdown_table())
    print()
    print(patches.markdown_table())

"""Print the table of transformers internals hf_kvcache relies on, for docs/upstream_contracts.md (which
tests/test_upstream_contracts.py checks against the registry)."""

import hf_kvcache  # noqa: F401  (imports every contract)
from hf_kvcache.integration.contracts import markdown_table

if __name__ == "__main__":
    print(markdown_table())

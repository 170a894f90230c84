"""`python -m hf_kvcache.cli` = the `hf-kvcache` command."""

import sys

from .app import main

sys.exit(main())

"""The `hf-kvcache` command (`app`: `main`, `build_parser`): its argument types (`args`), the evaluation commands
(`eval_commands`), the demo budget sweep (`demo`, `demo_report`).

May import: everything.
"""

from .app import build_parser, main

__all__ = ["build_parser", "main"]

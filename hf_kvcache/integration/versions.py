"""Which transformers releases hf_kvcache is tested with, and the error for one it cannot serve.

The declared range (setup.cfg `install_requires`) is the tested range: it stops at the first minor release CI has
not run. `import hf_kvcache` on a version outside it still imports (one warning naming the range), so a user can
read the docs, load configs and see what breaks; a feature whose contract check fails then raises
`UnsupportedTransformersError` (hf_kvcache.integration.contracts), never a silent fallback.
"""

from __future__ import annotations

import warnings

import transformers
from packaging.version import Version

#: the minor releases CI runs (the full suite on the newest, contracts + smoke on the oldest); the range follows
TESTED_MINORS = ("5.23", "5.24")
_newest = Version(TESTED_MINORS[-1])
#: [oldest tested, first untested minor)
SUPPORTED_TRANSFORMERS = (Version(TESTED_MINORS[0]), Version(f"{_newest.major}.{_newest.minor + 1}"))
SUPPORTED_RANGE_TEXT = f">={TESTED_MINORS[0]},<{SUPPORTED_TRANSFORMERS[1]}"


class UnsupportedTransformersError(RuntimeError):
    """The installed transformers changed (or lacks) an internal that an hf_kvcache feature relies on."""


def installed() -> Version:
    """The installed transformers version (read once per call; tests may monkeypatch `transformers.__version__`)."""
    return Version(transformers.__version__)


def is_supported(version: Version | str | None = None) -> bool:
    version = Version(str(version)) if version is not None else installed()
    low, high = SUPPORTED_TRANSFORMERS
    return low <= version < high


def describe(version: Version | str | None = None) -> str:
    """'transformers X (hf_kvcache supports RANGE)' for error messages."""
    version = version if version is not None else installed()
    return f"transformers {version} (hf_kvcache is tested with transformers{SUPPORTED_RANGE_TEXT})"


def check_transformers_version(version: str | None = None) -> None:
    """Raise `UnsupportedTransformersError` when `version` (default: the installed one) is outside the tested range."""
    if not is_supported(version):
        raise UnsupportedTransformersError(
            f"hf_kvcache does not support {describe(version)}. Install a supported version: "
            f"pip install 'transformers{SUPPORTED_RANGE_TEXT}'."
        )


_warned = False


def warn_if_untested() -> bool:
    """Warn once per process when the installed transformers is outside the tested range; True when it is inside."""
    global _warned
    if is_supported():
        return True
    if not _warned:
        _warned = True
        warnings.warn(
            f"hf_kvcache: {describe()}. It imports, but each feature checks the transformers internals it relies on "
            f"and raises UnsupportedTransformersError if one changed. pip install 'transformers{SUPPORTED_RANGE_TEXT}' "
            "for the tested versions.",
            stacklevel=3,
        )
    return False

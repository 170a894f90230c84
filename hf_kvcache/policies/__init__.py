"""Policies decide which tokens stay in the cache and in which slot, from what their layer's `SlotView` shows them
(policies/view.py); they never import or reach into the layer."""

from .base import Placement, Policy
from .keep_all import KeepAllPolicy
from .sink_window import SinkWindowPolicy
from .view import Chunk, SlotView

__all__ = ["Chunk", "Placement", "Policy", "KeepAllPolicy", "SinkWindowPolicy", "SlotView"]

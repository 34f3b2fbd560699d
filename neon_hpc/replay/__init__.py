"""Delta router replay: the rollout client asks the engine only for the newest turn's routes.

See README.md beside this file for the format, the fallbacks and the measurements.
"""
from neon_hpc.replay.cache import FALLBACK_REASONS, ReplayStats, RouteCache, RouteMismatch
from neon_hpc.replay.client import ReplayConversation, is_transient

__all__ = ["FALLBACK_REASONS", "ReplayStats", "RouteCache", "RouteMismatch", "ReplayConversation",
           "is_transient"]

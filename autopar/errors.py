"""Typed errors. Each message says what was wrong and what to do about it."""


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class TraceError(AutoparError):
    """torch.export could not turn the model into a graph."""


class MeshError(AutoparError):
    """A mesh that cannot exist: bad shape, names, or a size that does not match the world."""


class ShardingError(AutoparError):
    """An invalid sharding spec or placement (a mesh axis used twice, an uneven split, ...)."""


class ReshardError(AutoparError):
    """No sequence of collectives turns one spec into the other."""


class PlanError(AutoparError):
    """No plan satisfies the constraints (for example the memory budget)."""


class ConfigError(AutoparError):
    """A bad argument to a public function or the CLI."""


class RankError(AutoparError):
    """A rank of a multi-process run failed (raised, died or timed out); the message carries its traceback."""


class CheckpointError(AutoparError):
    """A checkpoint that is missing, incomplete (its save did not finish) or not this model's."""

"""Strategy rules by op family; importing this package registers them all."""
from autopar.sharding_spec.rules import matmul  # noqa: F401

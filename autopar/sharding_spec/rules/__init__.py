"""Strategy rules by op family; importing this package registers them all."""
from autopar.sharding_spec.rules import (  # noqa: F401
    attention,
    constant,
    conv,
    embedding,
    index,
    loss,
    matmul,
    norm,
    pointwise,
    reduction,
    scatter,
    view,
)

"""Per-node sharding strategies: which placements each op of a captured step can run with on a mesh.

The ILP (:mod:`hf_colossal_auto.solve`) picks one strategy per node; this package supplies the candidates,
from DTensor's own sharding rules where they exist and from :mod:`.custom_rules` where they do not, in a
small JSON-friendly vocabulary (:mod:`.placements`) rather than DTensor objects.
"""

from .custom_rules import CUSTOM_RULES, custom_strategies
from .dtensor_rules import dtensor_rule_kind, dtensor_strategies, resolve_op
from .enumerate import (
    clear_cache,
    device_mesh,
    enumerate_strategies,
    fallback_ops,
    node_strategies,
    ops_without_dtensor_rule,
)
from .placements import (
    PARTIAL,
    REPLICATE,
    Placement,
    PlacementSpec,
    Strategy,
    StrategySource,
    evenly_sharded,
    from_dtensor,
    from_dtensor_spec,
    is_partial,
    is_replicate,
    is_shard,
    local_shape,
    partial,
    replicate_strategy,
    shard,
    shard_dim,
    to_dtensor,
    to_dtensor_spec,
)

__all__ = [
    "CUSTOM_RULES",
    "PARTIAL",
    "REPLICATE",
    "Placement",
    "PlacementSpec",
    "Strategy",
    "StrategySource",
    "clear_cache",
    "custom_strategies",
    "device_mesh",
    "dtensor_rule_kind",
    "dtensor_strategies",
    "enumerate_strategies",
    "evenly_sharded",
    "fallback_ops",
    "ops_without_dtensor_rule",
    "from_dtensor",
    "from_dtensor_spec",
    "is_partial",
    "is_replicate",
    "is_shard",
    "local_shape",
    "node_strategies",
    "partial",
    "replicate_strategy",
    "resolve_op",
    "shard",
    "shard_dim",
    "to_dtensor",
    "to_dtensor_spec",
]

from .brute_force import brute_force
from .ilp import available_solvers, solve
from .problem import (
    ConditionalCost,
    DecisionEdge,
    DecisionNode,
    FollowsInputs,
    InfeasibleError,
    MemoryConstraint,
    Overlap,
    Problem,
    SharedCost,
    Solution,
    evaluate,
    memory_usage,
)

__all__ = [
    "ConditionalCost",
    "DecisionEdge",
    "DecisionNode",
    "FollowsInputs",
    "Overlap",
    "InfeasibleError",
    "MemoryConstraint",
    "Problem",
    "SharedCost",
    "Solution",
    "available_solvers",
    "brute_force",
    "evaluate",
    "memory_usage",
    "solve",
]

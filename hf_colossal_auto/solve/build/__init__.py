"""The ILP of one candidate, built in named parts (:mod:`.builder` assembles :mod:`.nodes`, :mod:`.edges`,
:mod:`.recompute`, :mod:`.memory_rows` and :mod:`.expert_exchange`)."""

from .builder import BuiltProblem, build_problem
from .expert_exchange import ExpertExchange, expert_exchanges

__all__ = ["BuiltProblem", "ExpertExchange", "build_problem", "expert_exchanges"]

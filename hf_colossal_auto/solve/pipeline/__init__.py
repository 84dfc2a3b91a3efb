"""The search over pipeline stages (issue 27): for each pp degree, the layout inside a stage (tensor parallelism,
the data-parallel mode, recompute per block), the cut of the model's blocks into stages, the schedule and the
micro-batch count, jointly, priced by simulating the schedule.

What is searched. Mesh ``("pp", "dp", "tp")`` with pp leading (the Plan contract: pp is the outer, strided axis,
so a replica group ``dp x tp`` is consecutive ranks). For each pp degree, every inner mesh ``(dp, tp)`` of the
``devices / pp`` devices with ``tp`` dividing a node and the attention heads, each with DDP, FSDP (over all dp
ranks) or HSDP (shard groups of whole nodes' data-parallel ranks, as the flat search offers them). Whether pp or
dp crosses nodes follows from the degrees chosen (tp = 8 fills a node: both cross; pp inside a node happens when
``dp x tp`` is smaller than a node), and each is priced on the link it crosses.

The modules, each with one job: :mod:`.costs` (what a unit, a stage layout and a model cost, the candidate a
pricing returns), :mod:`.pricing` (a stage layout's costs read off the inner ILPs, the data-parallel side priced
as a pipeline runs it), :mod:`.schedules` (the schedules and micro-batch counts offered), :mod:`.cut` (the cut,
recompute per block, and the simulation of one candidate), :mod:`.search` (the candidates' order and pruning)
and :mod:`.plan` (the Plan a candidate becomes, the planner's entry points and hand configurations).
"""

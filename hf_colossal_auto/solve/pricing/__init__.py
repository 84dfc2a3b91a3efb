"""Where each cost of the ILP is computed: :mod:`.compute` (op seconds), :mod:`.comm` (collectives, reshardings,
data-parallel synchronisation), :mod:`.memory` (liveness), :mod:`.collectives` (what a solved plan issues)."""

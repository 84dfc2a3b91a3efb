"""When a pipeline rank knows that a gradient it sent back has arrived, from the schedule's order alone.

Why: torch's multi-stage runtime (interleaved 1F1B, interleaved zero bubble, ZB-V) waits every send's work only
at the end of the step, so each input gradient a stage sends back to the previous stage's rank lives to the
step's end: at 405B with Llama 3's 4-D layout (16 stages of 2 per rank, 32 micro-batches, fp32 hidden states of
512 MiB) about 32 GiB a rank that nothing reads. Waiting each send early is unsafe in general (a send may wait
on a receive the peer posts only after it has waited on something from us). But a send's tensor can be freed
safely once the sender holds *proof* that the receiver has it: the receiver waits on that gradient's receive
at its backward of that micro-batch, so any message it sends to us after that backward began, once we have
received it, proves the gradient arrived; waiting the send's work then returns at once.

What: :func:`gradient_send_releases` reads each rank's compute actions (torch's own order) and the stages'
ranks, and says, for each gradient sent to another rank, the first action of the sender whose received input
was sent after the receiver's wait on that gradient: the runtime frees the send when it reaches that action
(:mod:`hf_colossal_auto.apply.pipeline_sends`), and the schedule's pricing holds its bytes until then
(:mod:`hf_colossal_auto.solve.pricing.pipeline_schedule`). The two share this module, so it imports neither.

The runtime it describes (torch's ``_PipelineScheduleRuntime``): a rank sends an activation right after the
forward that made it and a gradient right after the backward (full or input) that made it; it waits on a
received activation as the forward that reads it starts, on a received gradient as the backward that reads it
starts (full or input gradient, whichever comes first). Stages next to each other on one rank exchange nothing.
"""

from __future__ import annotations

Action = tuple[str, int, int]
"""``(kind, stage, micro-batch)``: kind "F" (forward), "B" (full backward), "I" (input gradient), "W" (weight
gradient)."""

GradientSend = tuple[int, int]
"""``(stage, micro-batch)``: the input gradient that stage's backward of that micro-batch sends back."""


def gradient_send_releases(actions: list[list[Action]], owner: list[int]) -> dict[Action, list[GradientSend]]:
    """Per action, the gradient sends of its rank proven received by the time that action's input has
    arrived (its receive waited), so freed as it starts. A send with no such later action on its rank (nothing
    the receiver did after its receipt reaches this rank before the step ends) is in no list: it lives to the
    step's end.

    ``actions``: per pp rank, its compute actions in the order it runs them (no idle slots); ``owner``: the pp
    rank of each stage. The proof may come through other ranks (a message from a rank that had a message from
    the receiver, ...): each action's vector clock says, per rank, how far along its list this action is known
    to come after."""
    position = [{action: i for i, action in enumerate(rank)} for rank in actions]
    clocks = _vector_clocks(actions, position, owner)
    releases: dict[Action, list[GradientSend]] = {}
    for rank, rank_actions in enumerate(actions):
        for index, (kind, stage, mb) in enumerate(rank_actions):
            if kind not in ("B", "I") or stage == 0 or owner[stage - 1] == rank:
                continue  # no input gradient sent, or sent to a stage of this rank (no message)
            receiver = owner[stage - 1]
            received = _first_backward_position(position[receiver], stage - 1, mb)
            for later in range(index + 1, len(rank_actions)):
                if clocks[rank][later][receiver] >= received:
                    releases.setdefault(rank_actions[later], []).append((stage, mb))
                    break
    return releases


def _vector_clocks(
    actions: list[list[Action]], position: list[dict[Action, int]], owner: list[int]
) -> list[list[list[int]]]:
    """Per rank and action, per rank the last position of that rank's list this action is known to follow
    (-1: none): the rank's previous action's clock, merged with the clock of the action that sent the message
    this action waits on. Computed in an order the schedule could run (an action once its message's sender
    has run)."""
    ranks = len(actions)
    clocks: list[list[list[int]]] = [[] for _ in range(ranks)]
    progress = True
    while progress:
        progress = False
        for rank in range(ranks):
            while len(clocks[rank]) < len(actions[rank]):
                index = len(clocks[rank])
                clock = list(clocks[rank][-1]) if clocks[rank] else [-1] * ranks
                source = _message_source(actions[rank][index], rank, position, owner)
                if source is not None:
                    sender, at = source
                    if len(clocks[sender]) <= at:
                        break  # its message is not sent yet: another rank first
                    clock = [max(a, b) for a, b in zip(clock, clocks[sender][at], strict=True)]
                clock[rank] = index
                clocks[rank].append(clock)
                progress = True
    stuck = [rank for rank in range(ranks) if len(clocks[rank]) < len(actions[rank])]
    if stuck:
        raise ValueError(
            f"the schedule's actions wait on each other (ranks {stuck}): not a schedule that runs"
        )
    return clocks


def _message_source(
    action: Action, rank: int, position: list[dict[Action, int]], owner: list[int]
) -> tuple[int, int] | None:
    """The rank and position of the action whose sent message ``action`` waits on (None: it waits on none)."""
    kind, stage, mb = action
    if kind == "F" and stage > 0 and owner[stage - 1] != rank:
        sender = owner[stage - 1]
        return sender, position[sender][("F", stage - 1, mb)]
    if kind in ("B", "I") and stage + 1 < len(owner) and owner[stage + 1] != rank:
        if _first_backward_position(position[rank], stage, mb) != position[rank][action]:
            return None  # the gradient was waited on by this micro-batch's earlier backward action
        sender = owner[stage + 1]
        return sender, _first_backward_position(position[sender], stage + 1, mb)
    return None


def _first_backward_position(position: dict[Action, int], stage: int, mb: int) -> int:
    """Where a rank runs the first backward action (full or input gradient) of ``(stage, mb)``: where it waits
    on the received gradient, and after which it sends its own input gradient."""
    found = [position[a] for a in (("B", stage, mb), ("I", stage, mb)) if a in position]
    if not found:
        raise ValueError(
            f"stage {stage} never runs the backward of micro-batch {mb}: not a training schedule"
        )
    return min(found)

"""Where an HF decoder-only causal LM can be cut into pipeline stages, and which modules each stage holds.

A pipeline stage is a contiguous run of the model's blocks; what runs before the first block (the token
embedding, learned position embeddings) lands on the first stage and what runs after the last (the final norm,
the LM head) on the last. This module reads that structure off the model — the base model
(``model.base_model``), its one list of blocks, the input and output embeddings transformers names — and
checks a plan's :attr:`~hf_colossal_auto.plan.Plan.stages` against it. The planner (which stage cuts to
price) and the runtime (:mod:`hf_colossal_auto.apply.pipeline`, which modules a rank builds) share it, so it
imports neither.

Supported: causal LMs whose base model is ``embedding (+ learned positions) -> blocks -> final norm`` and whose
head is the model's output embedding (Llama, Mistral, Qwen2, GPT-2 families). Parameter-less children of the
base model (rotary embeddings) run on every stage, as the model's own forward computes them; dropout before the
blocks runs on the first stage only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from .plan import Plan


class PipelineLayoutError(ValueError):
    """The model cannot be cut into pipeline stages, or a plan's stages do not cut it at block boundaries."""


@dataclass(frozen=True)
class PipelineLayout:
    """The pipeline-relevant structure of one causal LM, in module FQNs of the full model."""

    model_class: str
    base: str
    """The base model (``"model"``, ``"transformer"``)."""
    blocks: str
    """The list of blocks (``"model.layers"``)."""
    num_blocks: int
    before: tuple[str, ...]
    """Modules with parameters that run before the blocks, the token embedding first (``"model.embed_tokens"``;
    GPT-2 also ``"transformer.wpe"``): the first stage's."""
    after: tuple[str, ...]
    """Modules with parameters that run after the blocks, the head last (``"model.norm"``, ``"lm_head"``): the
    last stage's."""
    dropouts: tuple[str, ...]
    """Dropout children of the base model (GPT-2's ``"transformer.drop"``): they act on the embeddings, so on
    the first stage only."""
    shared: tuple[str, ...]
    """Other parameter-less children of the base model (rotary embeddings): every stage runs them."""

    @property
    def embedding(self) -> str:
        return self.before[0]

    @property
    def head(self) -> str:
        return self.after[-1]

    def block(self, index: int) -> str:
        return f"{self.blocks}.{index}"

    def stage_modules(self, blocks_per_stage: list[int]) -> list[list[str]]:
        """The stages of a cut with ``blocks_per_stage[s]`` consecutive blocks in stage ``s`` (uneven counts
        allowed; a count of 0 only for the first or last stage, which hold the embedding or the head)."""
        if sum(blocks_per_stage) != self.num_blocks or any(n < 0 for n in blocks_per_stage):
            raise PipelineLayoutError(
                f"{self.model_class} has {self.num_blocks} blocks; a cut of {blocks_per_stage} blocks per stage "
                "does not hold each exactly once"
            )
        stages: list[list[str]] = []
        start = 0
        for count in blocks_per_stage:
            stages.append([self.block(i) for i in range(start, start + count)])
            start += count
        stages[0][:0] = list(self.before)
        stages[-1].extend(self.after)
        self.block_ranges(stages)  # refuses an empty middle stage
        return stages

    def even_cut(self, num_stages: int) -> list[list[str]]:
        """Blocks spread as evenly as they divide, the first stages taking one more when they do not."""
        if not 1 <= num_stages <= self.num_blocks:
            raise PipelineLayoutError(
                f"{self.model_class} has {self.num_blocks} blocks: it cannot be cut into {num_stages} stages of "
                "at least one block each; use fewer stages (pp_size x virtual stages)"
            )
        base, extra = divmod(self.num_blocks, num_stages)
        return self.stage_modules([base + (s < extra) for s in range(num_stages)])

    def block_ranges(self, stages: list[list[str]]) -> list[range]:
        """The blocks of each stage, after checking that the stages cut the model whole: each block in exactly
        one stage, consecutive runs in model order, the modules before the blocks in the first stage and those
        after in the last, nothing else. Raises :class:`PipelineLayoutError` naming what is wrong."""
        first, last = set(self.before), set(self.after)
        ranges: list[range] = []
        next_block = 0
        for index, modules in enumerate(stages):
            indices = []
            for fqn in modules:
                if fqn in first or fqn in last:
                    where = 0 if fqn in first else len(stages) - 1
                    if index != where:
                        role = "runs before the blocks" if fqn in first else "runs after the blocks"
                        raise PipelineLayoutError(
                            f"stage {index} holds {fqn!r}, which {role}: it belongs to stage {where}"
                        )
                    continue
                indices.append(self._block_index(fqn))
            expected = list(range(next_block, next_block + len(indices)))
            if indices != expected:
                raise PipelineLayoutError(
                    f"stage {index} holds blocks {indices}; stages hold consecutive blocks in model order, and "
                    f"this one must start at block {next_block} ({self.block(next_block)})"
                )
            if not indices and 0 < index < len(stages) - 1:
                raise PipelineLayoutError(
                    f"stage {index} holds no block; every middle stage needs at least one"
                )
            ranges.append(range(next_block, next_block + len(indices)))
            next_block += len(indices)
        missing = [m for m in (*self.before, *self.after) if not any(m in s for s in stages)]
        if next_block != self.num_blocks or missing:
            lost = [self.block(i) for i in range(next_block, self.num_blocks)] + missing
            raise PipelineLayoutError(
                f"the stages do not cover {self.model_class}: {len(lost)} modules are in no stage "
                f"({', '.join(lost[:4])}{', ...' if len(lost) > 4 else ''})"
            )
        return ranges

    def _block_index(self, fqn: str) -> int:
        prefix = self.blocks + "."
        rest = fqn[len(prefix) :] if fqn.startswith(prefix) else ""
        if not rest.isdigit() or int(rest) >= self.num_blocks:
            inside = rest.split(".", 1)[0]
            hint = (
                f"; stages are cut at whole blocks ({self.block(int(inside))})"
                if inside.isdigit() and "." in rest
                else ""
            )
            raise PipelineLayoutError(
                f"a stage lists {fqn!r}, which is not a block of {self.blocks} (0..{self.num_blocks - 1}) nor "
                f"one of {', '.join((*self.before, *self.after))}{hint}"
            )
        return int(rest)


def find_layout(model: nn.Module) -> PipelineLayout:
    """The pipeline structure of ``model`` (an HF causal LM), or :class:`PipelineLayoutError` saying why it
    cannot be cut."""
    name = type(model).__name__
    base = getattr(model, "base_model", None)
    prefix = getattr(model, "base_model_prefix", "")
    if base is None or base is model or not prefix or model.get_submodule(prefix) is not base:
        raise PipelineLayoutError(
            f"{name} has no base model under a head (model.base_model): pipeline stages are cut in HF causal "
            "LMs made of an embedding, a list of blocks, a final norm and an LM head (Llama, Qwen2, GPT-2...)"
        )
    fqn_of = {id(m): n for n, m in model.named_modules()}
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_fqn = fqn_of.get(id(head), ".") if head is not None else "."
    if "." in head_fqn or id(embedding) not in fqn_of:
        raise PipelineLayoutError(
            f"{name} has no LM head beside its base model (get_output_embeddings()): only causal LMs can be "
            "cut into pipeline stages"
        )
    lists = [n for n, child in base.named_children() if isinstance(child, nn.ModuleList)]
    if len(lists) != 1:
        raise PipelineLayoutError(
            f"{name}'s base model has {len(lists)} lists of blocks ({lists}); pipeline stages need exactly one "
            "repeated block list to cut"
        )
    before, after, dropouts, shared = [fqn_of[id(embedding)]], [], [], []
    for child_name, child in base.named_children():
        fqn = f"{prefix}.{child_name}"
        if child_name == lists[0] or child is embedding:
            continue
        if not any(True for _ in child.parameters()):
            (dropouts if isinstance(child, nn.Dropout) else shared).append(fqn)
        elif isinstance(child, nn.Embedding):
            before.append(fqn)  # learned positions, added to the token embeddings
        elif "norm" in type(child).__name__.lower():
            after.append(fqn)
        else:
            raise PipelineLayoutError(
                f"{name}'s base model has a {type(child).__name__} ({fqn}) that is neither an embedding nor a "
                "final norm; the pipeline runtime does not know which stage runs it"
            )
    others = [n for n, c in model.named_children() if c is not base and c is not head and any(c.parameters())]
    if others:
        raise PipelineLayoutError(
            f"{name} has modules with parameters outside its base model and head ({others}); the pipeline "
            "runtime does not know which stage runs them"
        )
    after.append(head_fqn)
    blocks = f"{prefix}.{lists[0]}"
    return PipelineLayout(
        model_class=name,
        base=prefix,
        blocks=blocks,
        num_blocks=len(model.get_submodule(blocks)),
        before=tuple(before),
        after=tuple(after),
        dropouts=tuple(dropouts),
        shared=tuple(shared),
    )


def hand_pipeline_plan(
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    pp_size: int,
    schedule: str,
    micro_batches: int,
    virtual_stages: int | None = None,
    blocks_per_stage: list[int] | None = None,
    dp_size: int = 1,
    dp_mode: str = "ddp",
    recompute: str = "none",
) -> Plan:
    """A pipeline plan written by hand for ``model`` (``pp_size`` ranks, times ``dp_size`` data-parallel
    replicas of the pipeline under ``dp_mode`` "ddp" or "fsdp"; no tensor parallelism):
    ``blocks_per_stage`` (default: as even as the blocks divide) over ``pp_size x virtual_stages`` stages
    (default: the fewest ``schedule`` runs), every parameter replicated on its stage (sharded on dim 0 over
    the data-parallel axis under FSDP, as the planner writes it), ``recompute`` ("none", "full",
    "selective:<classes>") on every block. For tensor parallelism inside the stages, give a planned plan its
    stages with :func:`pipeline_plan_from`.

    For running a chosen layout and for tests until the planner searches pipeline stages: its predicted
    figures (step time, memory) are not computed — they are 0 and ``solver["status"]`` says so."""
    from .plan import unpriced_plan

    if dp_mode not in ("ddp", "fsdp"):
        raise PipelineLayoutError(f"hand_pipeline_plan writes dp_mode 'ddp' or 'fsdp', not {dp_mode!r}")
    layout = find_layout(model)
    params = dict(model.named_parameters())
    shapes = {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")}
    rows = next(iter(shapes.values()))[0] if shapes else 0
    sharded = dp_mode == "fsdp" and dp_size > 1
    inner = unpriced_plan(
        model_class=layout.model_class,
        num_devices=dp_size,
        mesh_shape=(dp_size, 1),
        mesh_axis_names=("dp", "tp"),
        dp_mode=dp_mode,
        param_placements={fqn: ["S0" if sharded else "R", "R"] for fqn in params},
        global_batch_size=rows,
        input_shapes=shapes,
        recompute={layout.block(i): recompute for i in range(layout.num_blocks)}
        if recompute != "none"
        else {},
        solver={"status": "hand-made pipeline plan, not priced"},
        param_shapes={fqn: list(p.shape) for fqn, p in params.items()},
    )
    return pipeline_plan_from(
        inner,
        model,
        pp_size=pp_size,
        schedule=schedule,
        micro_batches=micro_batches,
        virtual_stages=virtual_stages,
        blocks_per_stage=blocks_per_stage,
    )


def sends_sequence_shards(
    layout: PipelineLayout, activation_placements: Mapping[str, list[str]], tp: int, seq_len: int
) -> bool:
    """Whether a pipeline's stages can send each tensor-parallel rank's sequence shard of the hidden states
    (:attr:`~hf_colossal_auto.plan.Plan.sequence_sharded_sends`) for free: tensor parallelism (``tp`` > 1), a
    sequence of ``seq_len`` that divides over it, and every block of ``layout`` returning its hidden states
    sharded on the sequence dim over tp (``"S1"`` on the placements' last axis, the tp axis: Megatron-LM's
    sequence parallelism), so that at any cut each rank already holds its shard — no gather before the send,
    none after the receive. Where a block returns them whole the stages send them whole (a shard would have to
    be gathered again by the next stage). The planner prices a pipeline by it and writes it in the plan; the
    runtime follows the plan."""
    if tp < 2 or seq_len <= 0 or seq_len % tp:
        return False
    return all(
        (activation_placements.get(layout.block(i)) or ["R"])[-1] == "S1" for i in range(layout.num_blocks)
    )


def pipeline_plan_from(
    plan: Plan,
    model: nn.Module,
    *,
    pp_size: int,
    schedule: str,
    micro_batches: int,
    virtual_stages: int | None = None,
    blocks_per_stage: list[int] | None = None,
) -> Plan:
    """``plan`` (a plan without pipeline stages, mesh ``(dp, tp)``: what every stage runs on its pp
    coordinate) with ``pp_size`` pipeline ranks in front: mesh ``("pp", "dp", "tp")`` over ``pp_size`` times
    its devices, every placement with the pp axis's ``"R"`` first (a stage's parameters live on its pp rank
    only; the runtime reads the ``(dp, tp)`` entries), and the pipeline fields — ``blocks_per_stage`` (default:
    as even as the blocks divide) over ``pp_size x virtual_stages`` stages (default: the fewest ``schedule``
    runs), ``micro_batches`` a step. Keys (parameter FQNs, module paths, recompute per block) stay the whole
    model's; the stages send sequence shards where :func:`sends_sequence_shards` says so. Its predicted figures
    stay ``plan``'s, which priced no pipeline."""
    import dataclasses

    from .plan import PIPELINE_SCHEDULES

    if plan.pp_size > 1:
        raise PipelineLayoutError("pipeline_plan_from takes a plan without pipeline stages")
    if tuple(plan.mesh_axis_names) != ("dp", "tp"):
        raise PipelineLayoutError(
            f"pipeline_plan_from takes a plan on a (dp, tp) mesh, not {tuple(plan.mesh_axis_names)}"
        )
    if schedule not in PIPELINE_SCHEDULES:
        raise PipelineLayoutError(f"unknown schedule {schedule!r}; one of {', '.join(PIPELINE_SCHEDULES)}")
    virtual = virtual_stages or PIPELINE_SCHEDULES[schedule][0]
    layout = find_layout(model)
    stages = (
        layout.even_cut(pp_size * virtual)
        if blocks_per_stage is None
        else layout.stage_modules(list(blocks_per_stage))
    )

    def lead(placements: dict[str, list[str]]) -> dict[str, list[str]]:
        return {key: ["R", *value] for key, value in placements.items()}

    return dataclasses.replace(
        plan,
        num_devices=pp_size * plan.num_devices,
        mesh_shape=(pp_size, *plan.mesh_shape),
        mesh_axis_names=("pp", "dp", "tp"),
        param_placements=lead(plan.param_placements),
        activation_placements=lead(plan.activation_placements),
        param_use_placements=lead(plan.param_use_placements),
        block_input_placements=lead(plan.block_input_placements),
        micro_batches=micro_batches,
        pp_size=pp_size,
        stages=stages,
        schedule=schedule,
        virtual_stages=virtual,
        sequence_sharded_sends=sends_sequence_shards(
            layout, plan.activation_placements, plan.tp_size, _sequence_length(plan)
        ),
    )


def _sequence_length(plan: Plan) -> int:
    """The sequence length of ``plan``'s batch (its ``input_ids``' second dim; 0 when it has none)."""
    shape = plan.input_shapes.get("input_ids") or []
    return int(shape[1]) if len(shape) > 1 else 0

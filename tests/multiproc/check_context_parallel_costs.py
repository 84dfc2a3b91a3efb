"""Run under torchrun (2 ranks): planner-made context-parallel plans' costs against measured steps.

    torchrun --nproc_per_node 2 tests/multiproc/check_context_parallel_costs.py --out r.json

A Llama at hidden 128 (grouped-query attention: 4 query heads, 2 K/V heads), 2 rows of 512 tokens, so that
activations dominate, in three kinds (:data:`PLANS`): plain rows (blocked attention), with attention dropout
0.1 (SDPA's unfused math path on CPU, every layer on the runtime's mask path) and padded rows (a 2-D padding
mask: every layer on the mask path). Rank 0 plans each with ``context_parallel=2`` on 2 CPU devices, DDP over
the ``dp x cp`` group, twice: with the budget lifted and no recompute, and under a budget of a fraction of that
plan's peak with recompute chosen by the solver (it must recompute to fit). Every rank applies each plan to a
fresh copy of the seeded model, in training mode, and runs training steps that read only the loss
(``model(**batch).loss``, as a training loop does: the runtime gathers no output over cp,
``apply/context_parallel_outputs.py``): one forward + backward under ``torch.profiler``, c10d's own records of
every collective (counts, and the bytes of the tensors handed to the all-gathers, reduce-scatters and the
generator agreement's broadcast) against the plan's ``collectives`` / ``collective_bytes``, and which
attention ran (blocked calls, whether dropout drew); then one AdamW step and MemTracker's peak of the next step
against ``plan.peak_memory_bytes``. ``<out>.rank<r>`` holds each rank's results.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, init_gloo, write_results
from torch.profiler import ProfilerActivity, profile

SEQ = 512
ROWS = 2

# c10d's records -> the kinds compared; the all-gather and reduce-scatter's tensors are recorded with shapes
# (output, input, ...): the bytes are the gathered tensor (the all-gather's output, the reduce-scatter's input)
_GATHERS = {"c10d::_allgather_base_": 0, "c10d::allgather_into_tensor_coalesced_": 0}
_SCATTERS = {"c10d::_reduce_scatter_base_": 1, "c10d::reduce_scatter_tensor_coalesced_": 1}
_REDUCES = ("c10d::allreduce_", "c10d::allreduce_coalesced_")
_BROADCASTS = ("c10d::broadcast_",)
_ELEMENT_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "unsigned char": 1}


PADDED = 100
"""The ``padded`` plan's rows: the last ``PADDED`` tokens of row 1 are padding (mask 0, labels -100)."""
DROPOUT = 0.1
"""The ``dropout`` plan's ``attention_dropout``: on a CPU target SDPA runs its unfused math path."""

PLANS = ("free", "tight", "dropout", "dropout-tight", "padded", "padded-tight")
"""The plans run: the plain model and rows (``free``: the budget lifted, no recompute; ``tight``: under a
fraction of that plan's peak, recompute chosen), then with attention dropout and padded rows, each both ways."""


def model_config(dropout: float = 0.0):
    from transformers import LlamaConfig

    return LlamaConfig(
        attention_dropout=dropout,
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        use_cache=False,
        tie_word_embeddings=False,
    )


def build(name: str = "plain"):
    """The seeded model of plan ``name`` (with attention dropout for ``dropout``), in training mode as a
    training loop runs it: the runtime's generator agreement (a broadcast per forward under cp) runs in
    training forwards only, and dropout draws only there."""
    from hf_colossal_auto.models import build_model

    torch.manual_seed(0)
    dropout = DROPOUT if name == "dropout" else 0.0
    model = build_model(model_config(dropout), device="cpu", attn_implementation="sdpa")
    return model.train()


def make_batch(name: str = "plain") -> dict[str, torch.Tensor]:
    """2 rows of 512 tokens; for ``padded`` row 1 ends in :data:`PADDED` padding tokens (a 2-D padding mask,
    labels ignored there), so that every layer runs on the runtime's mask path."""
    ids = torch.randint(0, 512, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if name == "padded":
        mask = torch.ones_like(ids)
        mask[1, SEQ - PADDED :] = 0
        batch["labels"][1, SEQ - PADDED :] = -100
        batch["attention_mask"] = mask
    return batch


def kind_of(name: str) -> str:
    """The model and rows of plan ``name``: ``dropout`` and ``padded`` (``-tight`` or not), else the plain ones."""
    kind = name.removesuffix("-tight")
    return kind if kind in ("dropout", "padded") else "plain"


def make_plans(fraction: float) -> list[str]:
    """The plans of :data:`PLANS` as JSON: for the plain model and rows, with attention dropout and for padded
    rows, cp = 2 with the budget lifted (no recompute) and under ``fraction`` of that plan's peak (recompute
    chosen by the solver)."""
    from hf_colossal_auto.solve.planner import plan_model

    common = dict(
        num_devices=2,
        device="cpu",
        mesh_shape=(1, 1),
        dp_modes=("ddp",),
        micro_batches=1,
        context_parallel=2,
    )
    plans = {}
    for kind in ("plain", "dropout", "padded"):
        model, batch = build(kind), make_batch(kind)
        free = plan_model(model, batch, memory_budget=1 << 40, recompute="none", **common)
        budget = int(free.peak_memory_bytes * fraction)
        tight = plan_model(model, batch, memory_budget=budget, recompute="auto", **common)
        plans[kind], plans[f"{kind}-tight"] = free, tight
    names = {"free": "plain", "tight": "plain-tight"}
    return [plans[names.get(name, name)].to_json() for name in PLANS]


def _redispatched(event) -> bool:
    """A c10d record under a record of the same op: a selective checkpoint's dispatch mode (recording the
    recomputed block's ops) running the op it intercepted; one collective, recorded twice."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == event.name:
            return True
        parent = parent.cpu_parent
    return False


@contextlib.contextmanager
def recorded_broadcasts() -> Iterator[list[int]]:
    """The bytes of every ``torch.distributed.broadcast`` called for the duration (the runtime's generator
    agreement calls it, ``apply/rng.py``), appended to the list yielded."""
    sent: list[int] = []
    original = dist.broadcast

    @functools.wraps(original)
    def broadcast(tensor, *args, **kwargs):
        sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.broadcast = broadcast
    try:
        yield sent
    finally:
        dist.broadcast = original


def count_collectives(prof, broadcast_bytes: int) -> tuple[dict[str, int], dict[str, int]]:
    """Counts per kind (``cp_all_gather``, ``cp_reduce_scatter``, ``all_reduce``, ``broadcast``) and bytes (the
    gathered tensors) from c10d's records. c10d records a broadcast's tensors as a list without shapes: the
    broadcasts' bytes are ``broadcast_bytes``, what :func:`recorded_broadcasts` saw sent."""
    counts: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for event in prof.events():
        name = event.name
        if _redispatched(event):
            continue
        if name in _GATHERS or name in _SCATTERS:
            kind = "cp_all_gather" if name in _GATHERS else "cp_reduce_scatter"
            at = (_GATHERS | _SCATTERS)[name]
            shape, dtype = event.input_shapes[at], event.input_dtypes[at]
            n = 1
            for d in shape:
                n *= d
            counts[kind] += 1
            nbytes[kind] += n * _ELEMENT_BYTES[dtype]
        elif name in _REDUCES:
            counts["all_reduce"] += 1
        elif name in _BROADCASTS:
            counts["broadcast"] += 1
            nbytes["broadcast"] += broadcast_bytes
    return dict(counts), dict(nbytes)


def run_plan(name: str, text: str) -> dict:
    from common import measured_step_peak

    from hf_colossal_auto import Plan
    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.apply.rng import rng_of

    plan = Plan.from_dict(json.loads(text))
    model, batch = build(kind_of(name)), make_batch(kind_of(name))
    apply_plan(model, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    dist.barrier()
    with (
        recorded_broadcasts() as sent,
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
    ):
        loss = model(**batch).loss
        layout = model._hf_colossal_auto_context_parallel.layout
        paths = {"attention_calls": layout.attention_calls, "blocked_calls": layout.blocked_calls}
        drew = rng_of(model).draws  # did the forward advance the (agreed) generator: dropout drew
        loss.backward()
    counted, counted_bytes = count_collectives(prof, sum(sent))
    draws = sum(1 for e in prof.events() if e.name == "aten::bernoulli_" and not _redispatched(e))
    del prof, loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    measured = measured_step_peak(model, opt, batch)
    result = {
        "plan": name,
        "rank": dist.get_rank(),
        "recompute": sorted(set(plan.recompute.values())),
        "recomputed_blocks": sorted(plan.recompute),
        "predicted": {k: round(v) for k, v in plan.collectives.items() if v},
        "predicted_bytes": {k: round(v) for k, v in plan.collective_bytes.items() if v},
        "counted": counted,
        "counted_bytes": counted_bytes,
        **paths,
        "generator_advanced": drew,
        "bernoulli_calls": draws,
        "predicted_peak": plan.peak_memory_bytes,
        "measured_peak": measured,
        "budget": plan.memory_budget_bytes,
        "param_memory_bytes": plan.param_memory_bytes,
        "activation_memory_bytes": plan.activation_memory_bytes,
    }
    del model, opt
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fraction", type=float, default=0.75)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    init_gloo(timeout_s=300)
    from hf_colossal_auto.apply.agree import run_on_one_rank

    started = time.perf_counter()
    texts = json.loads(run_on_one_rank(lambda: json.dumps(make_plans(args.fraction)), what="planning"))
    planned = time.perf_counter()
    results = [run_plan(name, text) for name, text in zip(PLANS, texts, strict=True)]
    results.append({"plan_seconds": planned - started, "total_seconds": time.perf_counter() - started})
    write_results(results, args.out, per_rank=True)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_COLOSSAL_AUTO_NO_CALIBRATE", "1")
    main()

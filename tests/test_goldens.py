"""Golden plans: every ILP the planner builds and every plan, estimate, bound and frontier it writes, held to a
committed fixture (``tests/goldens/plans.json``).

Why: a change that should not change plans (a move, a rename, a faster builder) must leave every problem the
solver sees identical — node order is the solver's variable order and decides its ties, so a reordering is
caught here before the solver can hide it — and every result identical to the last bit. The matrix reaches the
planner's paths: tiny GPT-2, Llama, BERT, T5, Mixtral (uniform routing and a measured-style ``RoutingLoad``,
experts over the data-parallel axis under DDP and FSDP) and Qwen2-MoE; 1, 2, 8 and 16 devices (HSDP and the
pruning of the mesh search at 8 per node); generous, tight (recompute and micro-batches) and impossible budgets;
a datasheet preset and a calibrated JSON spec (per-kind collectives, DTensor's own, rank skew, in-step scales).

Each ``build_problem`` result is hashed in emission order (nodes with costs as ``float.hex``, edges, memory
rows, rules, overlaps, shared and conditional costs, and what the write-up reads back); results are hashed
without their timing fields. The fixture keeps the hashes and a few readable fields, so a failure says what
changed. A change meant to change plans regenerates it, with the reason in its commit::

    HF_COLOSSAL_AUTO_REGEN_GOLDENS=1 python -m pytest -q tests/test_goldens.py

Traces are shared between cases (one per model, rows and settings: tracing is deterministic), so the whole
matrix costs a few traces per model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hf_colossal_auto.capture.moe import RoutingLoad, experts_modules
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.solve import InfeasibleError
from hf_colossal_auto.solve.frontier import frontier
from hf_colossal_auto.solve.planner import evaluate_plan, plan_model

GOLDENS = Path(__file__).parent / "goldens"
FIXTURE = GOLDENS / "plans.json"
DEVICE_JSON = GOLDENS / "calibrated_device.json"
REGENERATE = os.environ.get("HF_COLOSSAL_AUTO_REGEN_GOLDENS") == "1"
TIMING_KEYS = frozenset({"solve_time_s", "total_planning_s"})
"""Wall-clock fields of a result: the only ones that may differ between two identical runs."""


# --------------------------------------------------------------------------------------------- canonical form
def _canon(value: Any) -> Any:
    """A JSON-ready form that is equal exactly when ``value`` is: floats as ``float.hex``, dataclasses as their
    fields in order, dict keys in order (emission order matters to the solver), sets sorted."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value.hex() if math.isfinite(value) else repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _canon(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return [[_canon(k), _canon(v)] for k, v in value.items()]
    if isinstance(value, (set, frozenset)):
        return sorted((_canon(v) for v in value), key=repr)
    if isinstance(value, (list, tuple)):
        return [_canon(v) for v in value]
    if hasattr(value, "value") and hasattr(value, "name"):  # an Enum
        return _canon(value.value)
    raise TypeError(f"golden canonical form: no rule for {type(value).__name__}")


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, separators=(",", ":")).encode()).hexdigest()


def _problem_form(problem: Any) -> dict[str, Any]:
    """The ILP as the solver reads it, field by field in emission order."""
    return {
        "name": problem.name,
        "nodes": [[n.name, _canon(n.costs), n.labels, n.multiplicity] for n in problem.nodes],
        "edges": [[e.src, e.dst, _canon(e.cost), e.multiplicity] for e in problem.edges],
        "memory": [
            [
                c.name,
                _canon(c.budget),
                _canon(c.constant),
                _canon(c.terms),
                _canon(c.edge_terms),
                c.apply_multiplicity,
            ]
            for c in problem.memory_constraints
        ],
        "fixed": _canon(problem.fixed),
        "equal_strategy": _canon(problem.equal_strategy),
        "conditional": [
            [c.src, c.dst, c.when_node, list(c.when), _canon(c.cost)] for c in problem.conditional_costs
        ],
        "shared": [[s.src, _canon(s.members), _canon(s.cost)] for s in problem.shared_costs],
        "follows_inputs": [[r.dst, list(r.sharding), _canon(r.inputs)] for r in problem.follows_inputs],
        "overlaps": [
            [o.name, _canon(o.comm), _canon(o.compute), _canon(o.efficiency)] for o in problem.overlaps
        ],
    }


BUILT_FIELDS = (
    "param_options",
    "param_of_node",
    "node_of_name",
    "block_of",
    "recompute_units",
    "recompute_options",
    "hold_nodes",
    "micro_batches",
    "dp_shard_size",
    "host_floor_s",
    "backward_ratios",
    "expert_data_parallel",
    "expert_dp_params",
)
"""What the write-up reads back from a built problem besides the ILP (its strategies are the graph's)."""


def _built_hash(built: Any) -> str:
    form = {"problem": _problem_form(built.problem)}
    form.update({name: _canon(getattr(built, name)) for name in BUILT_FIELDS})
    return _sha(form)


def _strip_timing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_timing(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, (list, tuple)):
        return [_strip_timing(v) for v in value]
    return value


def _result_form(value: Any) -> Any:
    """A Plan / Estimate / Frontier dict without timing fields, keys sorted as the Plan's JSON has them."""
    return _canon(json.loads(json.dumps(_strip_timing(value), sort_keys=True, default=list)))


# --------------------------------------------------------------------------------------------- interception
class _Recorder:
    """Hashes every built problem in emission order; shares traces between cases."""

    def __init__(self) -> None:
        self.builds: list[str] = []
        self.traces: dict[tuple, Any] = {}

    def wrap_build(self, build: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            built = build(*args, **kwargs)
            self.builds.append(_built_hash(built))
            return built

        recorded.__wrapped__ = build  # type: ignore[attr-defined]
        return recorded

    def wrap_trace(self, trace: Callable[..., Any]) -> Callable[..., Any]:
        def shared(model: Any, inputs: Any, **kwargs: Any) -> Any:
            shapes = tuple(
                (k, tuple(getattr(v, "shape", ())), str(getattr(v, "dtype", v))) for k, v in inputs.items()
            )
            key = (id(model), shapes, tuple(sorted(kwargs.items())))
            if key not in self.traces:
                self.traces[key] = trace(model, inputs, **kwargs)
            return self.traces[key]

        shared.__wrapped__ = trace  # type: ignore[attr-defined]
        return shared


def _patch_everywhere(mp: pytest.MonkeyPatch, attribute: str, wrap: Callable[[Any], Any]) -> int:
    """Replace the project's function ``attribute`` in every module that holds it (wherever the planner calls it
    from), so this test does not depend on the planner's file layout."""
    patched = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("hf_colossal_auto") or module is None:
            continue
        fn = module.__dict__.get(attribute)
        if callable(fn) and getattr(fn, "__module__", "").startswith("hf_colossal_auto"):
            mp.setattr(module, attribute, wrap(fn))
            patched += 1
    return patched


@pytest.fixture(scope="module")
def recorder() -> Iterator[_Recorder]:
    rec = _Recorder()
    with pytest.MonkeyPatch.context() as mp:
        assert _patch_everywhere(mp, "build_problem", rec.wrap_build), (
            "build_problem not found in the project"
        )
        assert _patch_everywhere(mp, "trace_training_step", rec.wrap_trace)
        yield rec


# --------------------------------------------------------------------------------------------- the matrix
_MODELS: dict[tuple[str, int], tuple[Any, dict[str, Any]]] = {}


def _model(name: str, batch: int = 8, seq: int = 32) -> tuple[Any, dict[str, Any]]:
    key = (name, batch)
    if key not in _MODELS:
        model = build_model(name, device="meta")
        _MODELS[key] = (model, make_example_inputs(model, batch, seq, device="meta"))
    return _MODELS[key]


TIGHT_GPT2 = 2_450_000
"""Per-device bytes under which tiny GPT-2 (8 x 32) on 2 devices needs recompute and micro-batches."""


def _plan_summary(plan: Any) -> dict[str, Any]:
    return {
        "mesh": list(plan.mesh_shape),
        "dp": plan.dp_label,
        "k": plan.micro_batches,
        "step_time_s": plan.step_time_s,
        "peak": plan.peak_memory_bytes,
        "recompute": sorted(set(dict(plan.recompute).values())),
    }


def _planned(name: str, batch: int = 8, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    model, inputs = _model(name, batch)
    plan = plan_model(model, inputs, **kwargs)
    return plan.to_dict(), _plan_summary(plan)


def _infeasible(name: str, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    model, inputs = _model(name)
    with pytest.raises(InfeasibleError) as info:
        plan_model(model, inputs, memory_budget=1, **kwargs)
    return {"min_required": info.value.min_required, "message": str(info.value)}, {
        "min_required": info.value.min_required
    }


def _estimates(name: str, recompute: str, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """ddp, fsdp, megatron and a tp_plan dict under one recompute option."""
    model, inputs = _model(name)
    tp_plan = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    out, summary = {}, {}
    for baseline in ("ddp", "fsdp", "megatron", tp_plan):
        est = evaluate_plan(model, inputs, baseline, recompute=recompute, **kwargs)
        key = baseline if isinstance(baseline, str) else "tp_plan"
        out[key] = {
            "name": est.name,
            "step_time_s": est.step_time_s,
            "peak": est.peak_memory_bytes,
            "mesh": list(est.mesh_shape),
            "dp_mode": est.dp_mode,
            "plan": est.plan.to_dict(),
        }
        summary[key] = [list(est.mesh_shape), est.step_time_s, est.peak_memory_bytes]
    return out, summary


def _tight_and_priced(**kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """Tiny GPT-2 on 2 devices under a budget that needs recompute and micro-batches, and that Plan priced back
    by ``evaluate_plan`` (its own recompute, then full with its use placements pinned)."""
    model, inputs = _model("tiny-gpt2")
    plan = plan_model(model, inputs, num_devices=2, memory_budget=TIGHT_GPT2, **kwargs)
    own = evaluate_plan(model, inputs, plan, num_devices=2, **kwargs)
    full = evaluate_plan(model, inputs, plan, num_devices=2, recompute="full", pin_uses=True, **kwargs)
    out = {"plan": plan.to_dict()}
    out.update(
        {
            e: [est.step_time_s, est.peak_memory_bytes, est.plan.to_dict()]
            for e, est in (("own", own), ("full", full))
        }
    )
    summary = _plan_summary(plan)
    summary.update(
        own=[own.step_time_s, own.peak_memory_bytes], full=[full.step_time_s, full.peak_memory_bytes]
    )
    return out, summary


def _moe_routing(name: str) -> RoutingLoad:
    model, _ = _model(name)
    counts = (60, 40, 20, 8, 12, 30, 50, 36, 44, 18, 26, 52, 10, 34, 22, 48)
    return RoutingLoad({fqn: counts[: module.num_experts] for fqn, module in experts_modules(model).items()})


def _frontier() -> tuple[Any, dict[str, Any]]:
    model, inputs = _model("tiny-gpt2")
    result = frontier(
        model,
        inputs,
        num_devices=2,
        device="a100-80gb",
        budgets=[2_900_000, 3_600_000, 8_000_000],
        progress=False,
    )
    summary = {a: [p.step_time_s for p in points] for a, points in result.curves.items()}
    return result.to_dict(), summary


A100 = {"device": "a100-80gb"}
CASES: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "gpt2-1-generous": lambda: _planned("tiny-gpt2", num_devices=1, **A100),
    "gpt2-2-tight": lambda: _tight_and_priced(**A100),
    "gpt2-2-tight-none": lambda: _planned(
        "tiny-gpt2", num_devices=2, memory_budget=TIGHT_GPT2, recompute="none", **A100
    ),
    "gpt2-2-two-stage": lambda: _planned(
        "tiny-gpt2", num_devices=2, memory_budget=3_200_000, recompute="two-stage", **A100
    ),
    "gpt2-2-impossible": lambda: _infeasible("tiny-gpt2", num_devices=2, **A100),
    # sharded data parallelism over the 16 only: DDP on (16, 1) runs on ordinary tensors and wins at this size,
    # and with DTensor's host cost tensor parallelism over 16 beats FSDP / HSDP over 16 (the host waits anyway)
    "gpt2-16-hsdp": lambda: _planned(
        "tiny-gpt2",
        batch=16,
        num_devices=16,
        devices_per_node=8,
        dp_modes=("fsdp", "hsdp"),
        mesh_shape=(16, 1),
        **A100,
    ),
    "gpt2-8-json-spec": lambda: _planned(
        "tiny-gpt2",
        num_devices=8,
        device=str(DEVICE_JSON),
        devices_per_node=4,
        dp_modes=("ddp", "fsdp", "hsdp"),
    ),
    "llama-4-bf16": lambda: _planned("tiny-llama", num_devices=4, mixed_precision="bf16", **A100),
    "llama-2-impossible": lambda: _infeasible("tiny-llama", num_devices=2, **A100),
    "bert-2": lambda: _planned("tiny-bert", num_devices=2, **A100),
    "t5-2-tp": lambda: _planned("tiny-t5", num_devices=2, mesh_shape=(1, 2), **A100),
    "mixtral-2-uniform": lambda: _planned("tiny-mixtral", num_devices=2, **A100),
    "mixtral-2-routed-ddp-ep": lambda: _planned(
        "tiny-mixtral",
        num_devices=2,
        mesh_shape=(2, 1),
        dp_modes=("ddp-ep",),
        routing=_moe_routing("tiny-mixtral"),
        **A100,
    ),
    "mixtral-2-routed-fsdp-ep": lambda: _planned(
        "tiny-mixtral",
        num_devices=2,
        mesh_shape=(2, 1),
        dp_modes=("fsdp-ep",),
        routing=_moe_routing("tiny-mixtral"),
        **A100,
    ),
    "qwen2moe-2": lambda: _planned("tiny-qwen2-moe", num_devices=2, **A100),
    "frontier-gpt2-2": _frontier,
}
for _option in ("none", "full", "auto", "selective:pointwise"):
    CASES[f"llama-4-baselines-{_option}"] = lambda option=_option: _estimates(
        "tiny-llama", option, num_devices=4, memory_budget=2_000_000, **A100
    )


# --------------------------------------------------------------------------------------------- the test
_REGENERATED: dict[str, Any] = {}


@pytest.fixture(scope="module")
def golden() -> Iterator[dict[str, Any]]:
    stored = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
    yield stored
    if REGENERATE and _REGENERATED:
        stored.update(_REGENERATED)
        FIXTURE.write_text(json.dumps(dict(sorted(stored.items())), indent=1, sort_keys=False) + "\n")


@pytest.mark.parametrize("case", list(CASES))
def test_golden(case: str, recorder: _Recorder, golden: dict[str, Any]) -> None:
    recorder.builds = []
    result, summary = CASES[case]()
    entry = {
        "summary": json.loads(json.dumps(summary)),
        "builds": len(recorder.builds),
        "builds_sha": _sha(recorder.builds),
        "build_shas": [h[:12] for h in recorder.builds],
        "result_sha": _sha(_result_form(result)),
    }
    if REGENERATE:
        _REGENERATED[case] = entry
        return
    assert case in golden, f"no golden for {case}: regenerate with HF_COLOSSAL_AUTO_REGEN_GOLDENS=1"
    want = golden[case]
    assert entry["summary"] == want["summary"], f"{case}: the result's readable fields changed"
    first = next(
        (i for i, (a, b) in enumerate(zip(entry["build_shas"], want["build_shas"], strict=False)) if a != b),
        min(len(entry["build_shas"]), len(want["build_shas"])),
    )
    assert entry["build_shas"] == want["build_shas"], (
        f"{case}: built problems changed from build {first} on ({len(want['build_shas'])} -> "
        f"{len(entry['build_shas'])} builds)"
    )
    assert entry["builds_sha"] == want["builds_sha"]
    assert entry["result_sha"] == want["result_sha"], f"{case}: the result changed (readable fields equal)"


def test_tight_and_json_cases_reach_their_paths(golden: dict[str, Any]) -> None:
    """The matrix reaches what it claims: the tight budget needs recompute and micro-batches, 16 devices at 8
    per node choose HSDP or prune to it, experts over dp are planned, and the impossible budget states a minimum."""
    if REGENERATE:
        pytest.skip("regenerating")
    tight = golden["gpt2-2-tight"]["summary"]
    assert tight["k"] > 1 or tight["recompute"] != ["none"]
    assert golden["gpt2-2-tight-none"]["summary"]["k"] > 1
    assert golden["mixtral-2-routed-ddp-ep"]["summary"]["dp"] == "ddp, experts over dp"
    assert golden["mixtral-2-routed-fsdp-ep"]["summary"]["dp"] == "fsdp, experts over dp"
    assert golden["gpt2-16-hsdp"]["summary"]["dp"].startswith("hsdp")
    assert golden["gpt2-2-impossible"]["summary"]["min_required"] > 1

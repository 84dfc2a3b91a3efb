"""Where a plan's predicted memory and a real step's part ways: the predicted live set at each memory moment
beside the measured live bytes through one step (the tool the tensor-parallel gap in docs/reliability.md was
found with).

Two parts, run one after the other:

``predict`` (one process): plans ``--model`` on ``--mesh`` at ``--fraction`` x the no-recompute peak (as
``tests/test_recompute.py`` does, :func:`tests.multiproc.common.plan_at_fraction`), saves the plan, and
prints every memory moment's value, the activation-peak row's terms at the chosen strategies (largest first,
with the node's module, op and strategy), and per moment of the unsharded trace the transient storages (held
by no forward node: gradients in flight), which the model prices unsharded.

``measure`` (under ``python -m torch.distributed.run --nproc_per_node <tp x dp>``): applies the saved plan,
runs a warm-up step (AdamW, foreach) and one step under ``MemTracker``; rank 0 prints the peak by category
and the live activation bytes at every module's entry and exit, and after every op from the head on (where
the loss runs outside any module)::

    python scripts/trace_step_memory.py predict --model tiny-gpt2 --mesh 1x2 --fraction 0.6 --plan p.json
    python -m torch.distributed.run --standalone --nproc_per_node 2 scripts/trace_step_memory.py measure \\
        --model tiny-gpt2 --plan p.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _batch(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    from hf_colossal_auto.models import make_example_inputs

    return make_example_inputs(model, args.batch, args.seq, seed=0)


def _model(args: argparse.Namespace) -> torch.nn.Module:
    from hf_colossal_auto.models import build_model

    torch.manual_seed(0)
    model = build_model(args.model, device="cpu")
    model.eval()  # no dropout, as the recompute checks run it
    return model


def _print_transients(builder: Any, kind: Any, snapshot: Any, unit: str | None) -> None:
    """The moment's transient: activation bytes no forward node holds (what the row prices unsharded)."""
    from hf_colossal_auto.solve.tied import _weighted

    saved = sum(_weighted(builder.tied, snapshot.by_node).values())
    transient = snapshot.by_kind.get("activation", 0) - saved
    print(f"moment {kind.value} {unit or ''}: transient {transient:,.0f} B (priced unsharded)")


def predict(args: argparse.Namespace) -> None:
    """Plan, save, and print the prediction's moments, activation-peak terms and transients."""
    sys.path.insert(0, str(ROOT / "tests/multiproc"))
    from common import plan_at_fraction

    from hf_colossal_auto.solve import candidates
    from hf_colossal_auto.solve.build import memory_rows
    from hf_colossal_auto.solve.build.names import MemoryRow, memory_row_name

    dp, tp = (int(x) for x in args.mesh.split("x"))
    made: list[tuple[Any, Any, Any]] = []
    make_plan = candidates._make_plan
    constraint_at = memory_rows._MemoryRowsPart._constraint_at
    seen: set[tuple[Any, str | None]] = set()

    def spy_plan(context, mesh, dp_mode, built, solution):
        made.append((context, built, solution))
        return make_plan(context, mesh, dp_mode, built, solution)

    def spy_row(self, kind, snapshot, current, rerun=None, *, unit=None):
        if self.tp == tp and (kind, unit) not in seen:
            seen.add((kind, unit))
            _print_transients(self, kind, snapshot, unit)
        return constraint_at(self, kind, snapshot, current, rerun, unit=unit)

    candidates._make_plan = spy_plan
    memory_rows._MemoryRowsPart._constraint_at = spy_row
    model = _model(args)
    plan = plan_at_fraction(
        model,
        _batch(model, args),
        mesh=(dp, tp),
        dp_mode=args.dp_mode,
        fraction=args.fraction,
        recompute="auto",
    )
    plan.save(args.plan)
    print("recompute", plan.recompute, "peak", plan.peak_memory_bytes)
    for name, value in plan.memory_moments:
        print(f"  {name:40s} {value:14,.0f}")
    context, built, solution = made[-1]
    problem, choice = built.problem, solution.choice
    row = problem.memory_constraint(memory_row_name(MemoryRow.ACTIVATION_PEAK))
    terms = [(t[choice[name]] * problem.node(name).multiplicity, name) for name, t in row.terms.items()] + [
        (m[choice[src]][choice[dst]] * problem.node(dst).multiplicity, dst)
        for (src, dst), m in row.edge_terms.items()
    ]
    print(f"activation-peak: constant (inputs, buffers, transient) {row.constant:,.0f} B")
    for value, name in sorted(terms, reverse=True):
        if not value:
            continue
        index = built.node_of_name.get(name)
        node = context.graph.nodes[index] if index is not None else None
        strategies = built.strategies.get(name)
        strategy = strategies[choice[name]] if strategies else ""
        where = f"{node.module or '<root>'} {node.op}" if node is not None else ""
        print(f"  {value:12,.0f} {name:36s} {where} {strategy}")


def measure(args: argparse.Namespace) -> None:
    """Apply the saved plan and print the step's live activation bytes (rank 0)."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_colossal_auto._torch_compat import MemTracker
    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.plan import Plan

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    model = _model(args)
    batch = _batch(model, args)
    apply_plan(model, Plan.load(args.plan))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    loss = model(**batch).loss  # warm-up: the optimizer state comes to exist
    loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, opt, *[v for v in batch.values() if isinstance(v, torch.Tensor)])
    cpu = torch.device("cpu")
    log: list[tuple[str, int, int]] = []

    def snap(tag: str) -> None:
        now = tracker.get_tracker_snapshot("current")[cpu]
        log.append((tag, now.get("Activation", 0), now["Total"]))

    class OpLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            snap(f"op   {func}")
            return out

    ops = OpLog()
    hooks = []
    for name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: snap(f"pre  {name}")))
        hooks.append(module.register_forward_hook(lambda m, a, o, name=name: snap(f"post {name}")))
    head = model.get_output_embeddings()

    def start_ops(module: torch.nn.Module, inputs: tuple) -> None:
        ops.__enter__()  # returns the mode: a pre-hook's return value would replace the head's inputs

    hooks.append(head.register_forward_pre_hook(start_ops, prepend=True))
    with tracker:
        loss = model(**batch).loss
        ops.__exit__(None, None, None)
        snap("forward done")
        loss.backward()
        snap("backward done")
        del loss
        opt.step()
    for hook in hooks:
        hook.remove()
    if dist.get_rank() == 0:
        peak = tracker.get_tracker_snapshot("peak")[cpu]
        print("peak", {getattr(k, "value", k): v for k, v in peak.items()})
        for tag, act, total in log:
            print(f"{tag:60s} activations {act:12,d} total {total:12,d}")
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("predict", "measure"))
    parser.add_argument("--model", default="tiny-gpt2")
    parser.add_argument("--mesh", default="1x2", help="DPxTP")
    parser.add_argument("--dp-mode", default="ddp")
    parser.add_argument("--fraction", type=float, default=0.6, help="budget / the no-recompute peak")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--plan", required=True, help="the plan file (written by predict, read by measure)")
    args = parser.parse_args()
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_COLOSSAL_AUTO_NO_CALIBRATE"):
        os.environ.setdefault(var, "1")
    import transformers

    transformers.logging.set_verbosity_error()
    if args.part == "predict":
        predict(args)
    else:
        measure(args)
        os._exit(0)  # gloo teardown done above; skip interpreter teardown of the process group's threads


if __name__ == "__main__":
    main()

"""Run under torchrun: a Megatron plan with its attention and MLP modules on local shards (``Plan.local_modules``)
against the same plan on DTensors and against one process, on real gloo ranks.

    torchrun --nproc_per_node 2 tests/multiproc/check_local_tensor_parallel.py --out result.json
    torchrun --nproc_per_node 4 tests/multiproc/check_local_tensor_parallel.py --mesh 2x2 --dp-mode fsdp --out r.json
    torchrun --nproc_per_node 2 tests/multiproc/check_local_tensor_parallel.py --bench 20 --out bench.json

Per model (``--model``, comma-separated: tiny-llama, tiny-gpt2 — its MLPs only, resid dropout 0 — or a preset),
both runs start from the same seeded weights; each rank of a data-parallel replica trains on the replica's rows.
Rank 0 writes, per run: the losses of ``--steps`` AdamW steps and the one-process losses (DDP's: the mean of the
replicas'), the largest gradient difference against one process after the first backward, the collectives of
one forward + backward by kind (``CommDebugMode``), and the aten ops dispatched on DTensors in
that step (a ``TorchDispatchMode`` sees each op before DTensor's dispatch: the ops DTensor's per-op cost is paid
on), rank 0's, and of them the most any rank dispatched inside the listed modules' forwards. ``--pp 2``: the plan
in two pipeline stages (1f1b, one block each, train mode: tiny-llama has no dropout). With
``--bench N``: the median wall time of N more steps (forward, backward, optimizer step) of each run.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import DTensor

from hf_colossal_auto._torch_compat import TorchDispatchMode, comm_debug_mode


class DTensorOps(TorchDispatchMode):
    """Counts the aten ops called with a DTensor among their arguments (each goes through DTensor's dispatch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.inside = 0  # of them, those dispatched while a listed module's forward runs
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            self.count += 1
            # CommDebugMode's module tracker reads each parameter's ``.data`` (a detach) in its pre-forward
            # hooks, which run inside the watched forward around every submodule: a tool's read, not the region's
            self.inside += self.depth > 0 and func is not torch.ops.aten.detach.default
        return func(*args, **(kwargs or {}))

    def watch(self, modules: list[torch.nn.Module]) -> None:
        """Count the ops dispatched inside ``modules``' forwards (the region's entry and exit included; not the
        module hooks around them, which the counting tools add) as ``inside``."""
        for module in modules:
            module.forward = self._watched(module.forward)

    def _watched(self, forward):
        def watched(*args, **kwargs):
            self.depth += 1
            try:
                return forward(*args, **kwargs)
            finally:
                self.depth -= 1

        return watched


def build(name: str) -> torch.nn.Module:
    """The seeded model in eval mode (no dropout: the comparison is exact); GPT-2 with no residual dropout (its
    MLP would draw it, which a local region refuses)."""
    from hf_colossal_auto.models import build_model, load_config

    config = load_config(name)
    if config.model_type == "gpt2":
        config.resid_pdrop = 0.0
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.eval()
    return model


def local_modules(model: torch.nn.Module) -> list[str]:
    """Every block's attention and MLP module; GPT-2's MLPs only (its ``c_attn`` splits q, k, v by the global
    width: its attention cannot run on local shards)."""
    gpt2 = model.config.model_type == "gpt2"
    suffixes = (".mlp",) if gpt2 else (".self_attn", ".mlp")
    return [n for n, _ in model.named_modules() if n.endswith(suffixes)]


def run(name: str, local: bool, args: argparse.Namespace) -> dict:
    from common import ddp_reference_loss, every_rank

    from hf_colossal_auto.apply import apply_plan, broadcast_plan
    from hf_colossal_auto.models import make_example_inputs
    from hf_colossal_auto.pipeline_layout import pipeline_plan_from
    from hf_colossal_auto.solve.planner import evaluate_plan

    rank, world = dist.get_rank(), dist.get_world_size()
    dp, tp = (int(x) for x in args.mesh.split("x"))
    model = build(name)
    listed = local_modules(model)
    batch = make_example_inputs(model, args.batch, args.seq, seed=0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    made = None
    if rank == 0:
        made = evaluate_plan(
            model, batch, "megatron", num_devices=world // args.pp, device="cpu", mesh_shape=(dp, tp)
        ).plan
        made.dp_mode = args.dp_mode
        made.dp_shard_size = dp if args.dp_mode == "fsdp" else 1
        if args.recompute != "none":
            made.recompute = {block: args.recompute for block in made.recompute}
        made.local_modules = listed if local else []
        if args.pp > 1:  # the same plan in every stage: one block a stage, 1f1b over two micro-batches
            blocks = len(made.recompute)
            made = pipeline_plan_from(
                made, model, pp_size=args.pp, schedule="1f1b", micro_batches=2,
                blocks_per_stage=[blocks // args.pp] * args.pp,
            )  # fmt: skip
    plan = broadcast_plan(made)
    if (
        args.pp > 1
    ):  # a pipeline's training forward runs the schedule (forward and backward) in train mode only
        model.train()
    apply_plan(model, plan)
    per_replica = args.batch // dp
    replica = (rank // tp) % dp  # mesh (pp, dp, tp), row-major
    rows = {k: v[replica * per_replica : (replica + 1) * per_replica] for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, ref_losses, worst, counts = [], [], 0.0, {}
    dispatched = DTensorOps()
    held = dict(model.named_modules())  # a pipeline rank holds its stage's modules
    dispatched.watch([held[fqn] for fqn in listed if fqn in held])
    ref_params = dict(reference.named_parameters())
    for step in range(args.steps):
        ref_loss = ddp_reference_loss(reference, batch, dp)
        ref_loss.backward()
        if step == 0:
            # torch's module tracker cannot follow a pipeline stage's backward (autograd.grad): counts only
            with comm_debug_mode(modules=args.pp == 1) as comm, dispatched:
                loss = model(**rows).loss
                loss.backward()
            counts = {str(k).split(".")[-1]: v for k, v in comm.get_comm_counts().items()}
            for fqn, p in model.named_parameters():
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                worst = max(worst, float((grad - ref_params[fqn].grad).abs().max()))
        else:
            loss = model(**rows).loss
            loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        every = [None] * world
        dist.all_gather_object(every, loss.item())
        losses.append(sum(every[r * tp] for r in range(dp)) / dp)
        ref_losses.append(ref_loss.item())
    times = []
    for _ in range(args.bench):
        dist.barrier()
        start = time.perf_counter()
        model(**rows).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    worst = max(every_rank(worst))  # a pipeline rank compares its own stage's gradients
    inside = max(every_rank(dispatched.inside))
    result = {
        "model": name,
        "local_modules": len(plan.local_modules),
        "losses": losses,
        "reference_losses": ref_losses,
        "max_grad_diff": worst,
        "collectives": counts,
        "dtensor_ops": dispatched.count,
        "dtensor_ops_in_listed_forwards": inside,
        "median_step_s": statistics.median(times) if times else None,
        "steps_timed": len(times),
    }
    del model, opt, reference, ref_opt
    dist.barrier()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-llama", help="presets, separated by commas")
    parser.add_argument("--mesh", default="1x2")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (1f1b) in front of the mesh")
    parser.add_argument("--dp-mode", default="ddp", choices=["ddp", "fsdp"])
    parser.add_argument(
        "--recompute", default="none", help="every block's recompute option: none, full, selective:..."
    )
    parser.add_argument("--batch", type=int, default=4, help="global batch")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--bench", type=int, default=0, help="steps timed after the checked ones")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from common import close_gloo, init_gloo, write_results

    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    results = [run(name, local, args) for name in args.model.split(",") for local in (False, True)]
    write_results(results, args.out, indent=1)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()

"""Run under torchrun (2 gloo ranks): expert parallelism over the data-parallel axis against one process.

    torchrun --nproc_per_node 2 tests/multiproc/check_expert_dp.py --out result.json

Three models, each on a 2 x 1 mesh with every MoE layer's experts sharded over the data-parallel axis
(``Plan.expert_data_parallel``): tiny Mixtral under the plan the planner makes when asked for that mode by name
(``dp_modes=("ddp-ep",)``, DDP for the other parameters), and Mixtral at hidden 256, intermediate 1024, 8
experts, batch 2 x 8 under "fsdp-ep" (FSDP for the other parameters; the planner's own choice there until FSDP
without tensor parallelism ran on ordinary tensors, tests/test_expert_dp.py), and tiny Qwen2-MoE (a shared expert next to the routed ones) under the "ddp-ep" plan; and
last tiny Mixtral again under "fsdp-ep" (with its micro-batched step, HF checkpoint and resume). Each rank trains its replica's rows for two AdamW steps
(gradients clipped to norm 1 by ``torch.nn.utils.clip_grad_norm_``, which the norms are recorded of);
rank 0 writes, per model: the losses and the one-process reference's (the mean of the replicas' losses, what DDP
computes), the largest first-step gradient difference, the collectives each rank ran in the first step's forward
and backward (counted as the fidelity tests count them; FSDP's all-gathers and reduce-scatters by the elements
of each rank's shard) and the plan's prediction, and after training the
largest difference between the consolidated export (``save_pretrained``, loaded with ``from_pretrained`` in
one process) and the reference model trained on the whole batch.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, ddp_reference_loss, init_gloo, out_argument, write_results
from torch.distributed.tensor import DTensor

from hf_colossal_auto.integrations.process_exit import finish


def _model(name: str):
    from common import wide_mixtral

    from hf_colossal_auto.models import build_model

    if name.startswith("tiny-"):
        torch.manual_seed(0)
        return build_model(name, device="cpu")
    return wide_mixtral()


def _counting(all_reduce, reduced: list):
    """``all_reduce`` recording each tensor it is given in ``reduced``."""

    def counted(tensor, *args, **kwargs):
        reduced.append(tensor)
        return all_reduce(tensor, *args, **kwargs)

    return counted


def _fsdp_collectives(record: dict):
    """Wrappers of the collectives FSDP2 runs (``dist.all_gather_single``, ``dist.reduce_scatter_single``:
    plain, not functional, collectives) recording the elements of each one's per-rank shard under
    ``record[phase]`` ("phase" names the step's part being run: forward or backward)."""
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def gathered(output, input, *args, **kwargs):
        record.setdefault(f"{record['phase']}_all_gather", []).append(input.numel())
        return gather(output, input, *args, **kwargs)

    def scattered(output, input, *args, **kwargs):
        record.setdefault("reduce_scatter", []).append(output.numel())
        return scatter(output, input, *args, **kwargs)

    return gathered, scattered


def _fsdp_shards(model, plan) -> dict:
    """What FSDP should gather and reduce-scatter of ``model`` in one step: every parameter but the experts
    sharded over dp, each rank's shard (dim 0 padded to a multiple of dp, as FSDP2 pads), in elements."""
    from hf_colossal_auto.apply.runtime import expert_data_parallel_params

    dp = plan.dp_size
    experts = expert_data_parallel_params(model, plan)
    shards = {
        fqn: -(-p.shape[0] // dp) * (p.numel() // p.shape[0])
        for fqn, p in model.named_parameters()
        if fqn not in experts
    }
    trained = [fqn for fqn, p in model.named_parameters() if fqn in shards and p.requires_grad]
    return {"params": len(shards), "trained": len(trained), "shard_numel": sum(shards.values())}


def _bytes_over_ranks(recorded: dict) -> dict:
    """The bytes each rank handed its collectives, by kind, and their mean over the ranks: an all-to-all's
    share of a rank depends on the routing, the mean does not (a collective call: every rank calls it)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dict(recorded))
    kinds = sorted({k for ranked in every for k in ranked})
    mean = {k: sum(ranked.get(k, 0) for ranked in every) / len(every) for k in kinds}
    return {"bytes_by_rank": every, "bytes_mean": mean}


def run_case(name: str, batch_rows: int, seq: int, dp_modes: tuple[str, ...] | None, out_dir: str) -> dict:
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.apply.checkpoint import consolidated_state_dict
    from hf_colossal_auto.apply.pretrained import save_pretrained
    from hf_colossal_auto.apply.simulate import _CollectiveRecorder
    from hf_colossal_auto.models import make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world
    model = _model(name)
    model.eval()  # no dropout: the comparison is exact
    batch = make_example_inputs(model, batch_rows, seq, seed=0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    made = None
    if rank == 0:
        kwargs = {"dp_modes": dp_modes} if dp_modes else {}
        made = plan_model(model, batch, num_devices=world, device="cpu", mesh_shape=(dp, 1), **kwargs)
    plan = broadcast_plan(made)
    autoparallelize(model, plan=plan)
    per_replica = batch_rows // dp
    local = {k: v[rank * per_replica : (rank + 1) * per_replica] for k, v in batch.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, ref_losses, worst, norms = [], [], 0.0, []
    ran: dict = {}
    for step in range(2):
        ref_loss = ddp_reference_loss(reference, batch, dp)
        ref_loss.backward()
        recorder = _CollectiveRecorder()
        all_reduce, reduced = dist.all_reduce, []
        gather, scatter, fsdp = dist.all_gather_single, dist.reduce_scatter_single, {"phase": "forward"}
        # DDP's gradient all-reduces and FSDP's gathers and reduce-scatters are plain (not functional)
        # collectives: counted by wrapping them
        dist.all_reduce = _counting(all_reduce, reduced)
        dist.all_gather_single, dist.reduce_scatter_single = _fsdp_collectives(fsdp)
        try:
            with recorder:
                loss = model(**local).loss
                fsdp["phase"] = "backward"
                loss.backward()
        finally:
            dist.all_reduce = all_reduce
            dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
        if step == 0:
            del fsdp["phase"]
            ran = {
                "counts": {**recorder.counts, "all_reduce (DDP)": len(reduced)},
                "fsdp": fsdp,
                **_bytes_over_ranks(recorder.bytes),
            }
            for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                worst = max(worst, float((grad - p_ref.grad).abs().max()))
        # gradient clipping as the Trainer does it (the expert gradients live on another mesh than the rest),
        # and the norm alone, as a loop that clips in two calls takes it
        alone = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        norms.append(
            (
                float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)),
                float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)),
                float(alone),
            )
        )
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        all_losses = [None] * world
        dist.all_gather_object(all_losses, float(loss.detach()))
        losses.append(sum(all_losses) / dp)
        ref_losses.append(float(ref_loss))
    export = os.path.join(out_dir, name)
    save_pretrained(model, export)
    consolidated = consolidated_state_dict(model)
    dist.barrier()
    export_diff = reference_diff = None
    if rank == 0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
        want = dict(reference.named_parameters())
        # the export is the trained model itself, bit for bit; and that model is the one-process one (two AdamW
        # steps amplify the gradients' rounding differences where a gradient is near zero)
        export_diff = max(float((p - consolidated[n]).abs().max()) for n, p in loaded.named_parameters())
        reference_diff = max(float((p - want[n]).abs().max()) for n, p in loaded.named_parameters())
    stored = model.model.layers[0].mlp.experts.gate_up_proj
    attention = model.model.layers[0].self_attn.q_proj.weight
    result = {
        "model": name,
        "dp_mode": plan.dp_mode,
        "dp_label": plan.dp_label,
        "fsdp_shards": _fsdp_shards(model, plan),
        "other_weight": {
            "placements": [str(p) for p in attention.placements],
            "mesh": attention.device_mesh.ndim,
        },
        "expert_data_parallel": plan.expert_data_parallel,
        "moe_layers": plan.moe_layers,
        "alternatives": [a["dp_label"] for a in plan.alternatives],
        "losses": losses,
        "reference_losses": ref_losses,
        "max_grad_diff": worst,
        "grad_norms": norms,
        "ran": ran,
        "predicted": {
            "counts": {k: v for k, v in plan.collectives.items() if k.startswith("dp_") and v},
            "bytes": {k: v for k, v in plan.collective_bytes.items() if k.startswith("dp_") and v},
        },
        "expert_weight": {
            "placements": [str(p) for p in stored.placements],
            "local_shape": list(stored.to_local().shape),
            "shape": list(stored.shape),
        },
        "export_diff": export_diff,
        "reference_diff": reference_diff,
        "export_names": sorted(consolidated) == sorted(reference.state_dict()),
    }
    del model, opt, reference, ref_opt
    dist.barrier()
    return result


def run_micro_batches(dp_mode: str = "ddp-ep") -> dict:
    """Tiny Mixtral under the ``dp_mode`` plan ("ddp-ep" or "fsdp-ep") made for 2 micro-batches per replica: one
    step through :func:`hf_colossal_auto.accumulate` (the gradients of the experts divided by dp once, after the
    last piece) against one process, and the collectives it ran against the plan's."""
    from hf_colossal_auto import accumulate, autoparallelize
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.apply.simulate import _CollectiveRecorder
    from hf_colossal_auto.models import make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model("tiny-mixtral")
    model.eval()
    batch = make_example_inputs(model, 8, 16, seed=0)
    reference = copy.deepcopy(model)
    made = None
    if rank == 0:
        made = plan_model(
            model,
            batch,
            num_devices=world,
            device="cpu",
            mesh_shape=(world, 1),
            dp_modes=(dp_mode,),
            micro_batches=2,
        )
    plan = broadcast_plan(made)
    autoparallelize(model, plan=plan)
    per = 8 // world
    # the same pieces in one process (the router's load-balancing loss is per forward, so pieces change it)
    ref_loss = sum(
        reference(**{k: v[start : start + per // 2] for k, v in batch.items()}).loss / 2
        for start in range(0, 8, per // 2)
    )
    (ref_loss / world).backward()
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    recorder = _CollectiveRecorder()
    pieces, weights = 0, []
    gather, scatter, fsdp = dist.all_gather_single, dist.reduce_scatter_single, {"phase": "step"}
    dist.all_gather_single, dist.reduce_scatter_single = _fsdp_collectives(fsdp)
    try:
        with recorder:
            for micro in accumulate(model, local):
                (model(**micro.inputs).loss * micro.weight).backward()
                pieces += 1
                weights.append(float(micro.weight))
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter
    del fsdp["phase"]
    worst = 0.0
    for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((grad - p_ref.grad).abs().max()))
    result = {
        "dp_mode": plan.dp_mode,
        "fsdp": fsdp,
        "fsdp_shards": _fsdp_shards(model, plan),
        "micro_batches": plan.micro_batches,
        "pieces": pieces,
        "weights": weights,
        "expert_data_parallel": plan.expert_data_parallel,
        "max_grad_diff": worst,
        "ran": {"counts": dict(recorder.counts), **_bytes_over_ranks(recorder.bytes)},
        "predicted": {
            "counts": {k: v for k, v in plan.collectives.items() if k.startswith("dp_") and v},
            "bytes": {k: v for k, v in plan.collective_bytes.items() if k.startswith("dp_") and v},
        },
    }
    del model, reference
    dist.barrier()
    return result


def run_pretrained(out_dir: str, dp_mode: str = "ddp-ep") -> dict:
    """A HF checkpoint of tiny Mixtral loaded into a meta model under the ``dp_mode`` plan
    (``autoparallelize(..., pretrained=...)``: each rank reads its own experts): every replica's loss equals the
    one-process model's on its rows, and one step's gradients the one-process gradients."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.models import build_model, make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = _model("tiny-mixtral")
    reference.eval()
    directory = os.path.join(out_dir, f"pretrained-{dp_mode}")
    if rank == 0:
        reference.save_pretrained(directory)
    dist.barrier()
    batch = make_example_inputs(reference, 4, 16, seed=0)
    made = None
    if rank == 0:
        made = plan_model(
            reference, batch, num_devices=world, device="cpu", mesh_shape=(world, 1), dp_modes=(dp_mode,)
        )
    model = build_model("tiny-mixtral", device="meta")
    model.eval()
    autoparallelize(model, plan=broadcast_plan(made), pretrained=directory)
    per = 4 // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}
    with torch.no_grad():
        got, want = float(model(**local).loss), float(reference(**local).loss)
    pairs = [None] * world
    dist.all_gather_object(pairs, (got, want))
    # a backward too: the loaded parameters are the ones the gradient synchronisation was registered on
    ddp_reference_loss(reference, batch, world).backward()
    model(**local).loss.backward()
    worst = 0.0
    for p_ref, p in zip(reference.parameters(), model.parameters(), strict=True):
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((grad - p_ref.grad).abs().max()))
    stored = model.model.layers[0].mlp.experts.gate_up_proj
    return {
        "dp_mode": model._hf_colossal_auto_plan.dp_mode,
        "max_grad_diff": worst,
        "losses": pairs,
        "local_experts": stored.to_local().shape[0],
        "experts": stored.shape[0],
    }


def run_resume(out_dir: str, dp_mode: str = "ddp-ep") -> dict:
    """Tiny Mixtral under the ``dp_mode`` plan: one AdamW step, sharded state saved with
    ``torch.distributed.checkpoint`` (``save_checkpoint``), two more steps; then a fresh model under the same
    plan loads the state and runs the same two steps. Each rank's losses of both runs."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.apply.checkpoint import load_checkpoint, save_checkpoint
    from hf_colossal_auto.models import make_example_inputs
    from hf_colossal_auto.solve.planner import plan_model

    rank, world = dist.get_rank(), dist.get_world_size()
    directory = os.path.join(out_dir, f"resume-{dp_mode}")
    model = _model("tiny-mixtral")
    model.eval()
    batch = make_example_inputs(model, 4, 16, seed=0)
    made = None
    if rank == 0:
        made = plan_model(
            model, batch, num_devices=world, device="cpu", mesh_shape=(world, 1), dp_modes=(dp_mode,)
        )
    plan = broadcast_plan(made)
    per = 4 // world
    local = {k: v[rank * per : (rank + 1) * per] for k, v in batch.items()}

    def step(model, opt) -> float:
        loss = model(**local).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    autoparallelize(model, plan=plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt)
    save_checkpoint(model, opt, directory)
    uninterrupted = [step(model, opt), step(model, opt)]
    fresh = _model("tiny-mixtral")
    fresh.eval()
    autoparallelize(fresh, plan=plan)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(fresh, fresh_opt, directory)
    resumed = [step(fresh, fresh_opt), step(fresh, fresh_opt)]
    pairs = [None] * world
    dist.all_gather_object(pairs, (uninterrupted, resumed))
    del model, fresh, opt, fresh_opt
    dist.barrier()
    return {"dp_mode": plan.dp_mode, "ranks": pairs}


def _grad_gap(local, reference, name: str, rank: int, per_rank: int) -> float:
    """Largest gap between this rank's experts' gradient and the one-process gradient of those experts (no
    gradient at all counts as zero: experts no row reached)."""
    want = getattr(reference, name).grad[rank * per_rank : (rank + 1) * per_rank]
    got = getattr(local, name).grad
    return float(((got if got is not None else torch.zeros_like(want)) - want).abs().max())


def run_one_sided_routing() -> dict:
    """Every (token, expert) pair of both ranks routed to rank 0's experts, so rank 1 receives no rows and
    sends all of its own: the exchange (``apply/moe.py::_all_to_all_experts``) against transformers' experts
    forward on each rank's tokens in one process — outputs, the tokens' and routing weights' gradients, and
    the expert weights' gradient summed over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from hf_colossal_auto.apply.moe import _all_to_all_experts
    from hf_colossal_auto.capture.moe import experts_modules

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model("tiny-mixtral")
    experts = next(iter(experts_modules(model).values()))
    per_rank = experts.num_experts // world
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(world, 6, experts.gate_up_proj.shape[-1], generator=generator)
    index = torch.randint(0, per_rank, (world, 6, 2), generator=generator)  # rank 0's experts only
    index[..., 1] = (index[..., 0] + 1) % per_rank  # two different experts per token
    weights = torch.rand(world, 6, 2, generator=generator)
    reference = copy.deepcopy(experts)
    want_out, want_grads = [], []
    for r in range(world):
        h, w = hidden[r].clone().requires_grad_(), weights[r].clone().requires_grad_()
        out = reference(h, index[r], w)
        out.square().sum().backward()
        want_out.append(out.detach())
        want_grads.append((h.grad, w.grad))
    mesh = init_device_mesh("cpu", (world,))
    local = copy.deepcopy(experts)
    for name in ("gate_up_proj", "down_proj"):
        whole = getattr(local, name)
        mine = whole.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
        setattr(local, name, torch.nn.Parameter(mine))
    h, w = hidden[rank].clone().requires_grad_(), weights[rank].clone().requires_grad_()
    out = _all_to_all_experts(local, h, index[rank], w, mesh.get_group(), world, per_rank)
    out.square().sum().backward()
    gaps = {
        "output": float((out - want_out[rank]).abs().max()),
        "tokens_grad": float((h.grad - want_grads[rank][0]).abs().max()),
        "weights_grad": float((w.grad - want_grads[rank][1]).abs().max()),
        "expert_grad": max(
            _grad_gap(local, reference, name, rank, per_rank) for name in ("gate_up_proj", "down_proj")
        ),
        "rows_received": int(sum(int((index[r] // per_rank == rank).sum()) for r in range(world))),
    }
    every = [None] * world
    dist.all_gather_object(every, gaps)
    return {"gaps": every}


def main() -> None:
    out = out_argument()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    with tempfile.TemporaryDirectory() as tmp:
        # one directory for both ranks: rank 0's
        shared = [tmp]
        dist.broadcast_object_list(shared, src=0)
        results = [
            run_case("tiny-mixtral", 4, 16, ("ddp-ep",), shared[0]),
            run_case("wide-mixtral", 2, 8, ("fsdp-ep",), shared[0]),
            run_case(
                "tiny-qwen2-moe", 4, 16, ("ddp-ep",), shared[0]
            ),  # a shared expert next to the routed ones
            run_micro_batches(),
            run_pretrained(shared[0]),
            run_resume(shared[0]),
            run_one_sided_routing(),
            # FSDP with the experts sharded over dp and left out of FSDP ("fsdp-ep")
            run_case("tiny-mixtral", 4, 16, ("fsdp-ep",), shared[0]),
            run_micro_batches("fsdp-ep"),
            run_pretrained(shared[0], "fsdp-ep"),
            run_resume(shared[0], "fsdp-ep"),
        ]
        write_results(results, out)
        close_gloo()  # its barrier before rank 0 removes the shared directory
    os._exit(0)


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown

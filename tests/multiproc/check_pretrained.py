"""Run under torchrun (2 gloo ranks): HF checkpoints loaded shard by shard, exported streaming, resumed elastically.

    torchrun --standalone --nproc_per_node 2 tests/multiproc/check_pretrained.py --ckpt C --out O

``C/<preset>`` are tiny checkpoints written by ``save_pretrained(max_shard_size=...)`` into several files. For
each preset (Llama; GPT-2, whose lm_head is tied to wte) and each layout (``tp``: Megatron placements on 1 x 2;
``fsdp``: 2 x 1, FSDP2), every rank builds the model on ``meta``, applies the plan with ``pretrained=C/<preset>``
and compares every gathered parameter with ``from_pretrained`` in one process; it records the bytes its
parameters' storages take (a shard that were a view of a full tensor would count in full), its shards' bytes
and the bytes it read from the files. The model is then exported with ``save_pretrained`` into several files
(``O/export-<preset>-<layout>``), which the test loads with ``from_pretrained``. Two of the loads are repeated
through transformers' shard-on-read, the path of layouts the direct block read does not take.

Elastic resume: the Llama under ``tp`` trains two AdamW steps and writes its sharded state (DCP) to
``O/elastic``, then records the loss of the next step and of the step after it. A fresh model under ``fsdp``
loads that state and does the same two steps; the test compares them, and loads the state into one process too.
Rank 0 writes everything to ``O/result.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from common import close_gloo, every_rank, init_gloo, write_results
from torch.distributed.tensor import DTensor

PRESETS = ("tiny-llama", "tiny-gpt2")
LAYOUTS = {"tp": ((1, 2), "ddp"), "fsdp": ((2, 1), "fsdp")}
LR = 1e-3


def batches(config) -> list[dict]:
    """The four global batches the elastic check trains on (the same in the test's one-process resume)."""
    from hf_colossal_auto.models import make_example_inputs

    return [make_example_inputs(config, 4, 16, seed=s) for s in range(4)]


def _meta_model(directory: Path) -> torch.nn.Module:
    """The checkpoint's architecture on ``meta``, in eval mode (no dropout), as a user builds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def _planned(directory: Path, layout: str, save_plan: Path | None = None) -> torch.nn.Module:
    """A meta model planned (rank 0, Megatron placements; written to ``save_plan``) and applied with its
    weights from ``directory``."""
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.apply import broadcast_plan
    from hf_colossal_auto.solve.planner import evaluate_plan

    mesh, dp_mode = LAYOUTS[layout]
    model = _meta_model(directory)
    made = None
    if dist.get_rank() == 0:
        made = evaluate_plan(
            model, batches(model.config)[0], "megatron", num_devices=2, device="cpu", mesh_shape=mesh
        ).plan
        made.dp_mode = dp_mode
        if save_plan is not None:
            made.save(save_plan)
    return autoparallelize(model, plan=broadcast_plan(made), pretrained=directory)


def _storage_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the distinct storages behind this rank's parameters, bytes of its shards)."""
    storages: dict[int, int] = {}
    shards = 0
    for param in model.parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
        shards += local.numel() * local.element_size()
    return sum(storages.values()), shards


def _differs(model: torch.nn.Module, reference: torch.nn.Module) -> list[str]:
    """Names whose gathered values differ from the one-process model's (collective: every rank gathers)."""
    wanted = dict(reference.named_parameters(remove_duplicate=False))
    wanted.update(dict(reference.named_buffers()))
    bad = []
    for name, live in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]:
        value = live.full_tensor() if isinstance(live, DTensor) else live
        if not torch.equal(value.detach(), wanted[name].detach()):
            bad.append(name)
    return bad


def load_case(ckpt: Path, out: Path, preset: str, layout: str) -> tuple[dict, torch.nn.Module]:
    """Load ``preset`` under ``layout``, compare with from_pretrained, export; what the test asserts."""
    from common import allocation_peak
    from transformers import AutoModelForCausalLM

    import hf_colossal_auto.apply.pretrained.stream as stream
    from hf_colossal_auto.apply.pretrained import save_pretrained

    directory = ckpt / preset
    model = _planned(directory, layout, out / f"plan-{preset}-{layout}.json")
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    storage, shards = _storage_bytes(model)
    report = model._hf_colossal_auto_load_report
    case = {
        "differs": _differs(model, reference),
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
        "reference_tied": reference.lm_head.weight is reference.get_input_embeddings().weight,
        "storage_bytes": storage,
        "shard_bytes": shards,
        "full_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
        "bytes_read": report.bytes_read,
        "checkpoint_bytes": report.checkpoint_bytes,
    }
    # split tensors reach the writer in 4 KiB blocks (the default, 16 MiB, is above any tiny tensor): FSDP's
    # rows rank by rank, Megatron's row-parallel weights as full rows assembled from both ranks' columns
    block = stream.STREAM_BLOCK_BYTES
    stream.STREAM_BLOCK_BYTES = 4096
    try:
        saved, allocated = allocation_peak(
            lambda: save_pretrained(model, out / f"export-{preset}-{layout}", max_shard_size="200KB")
        )
    finally:
        stream.STREAM_BLOCK_BYTES = block
    case["export"] = {
        "files": len(saved.files),
        "peak_held": saved.peak_held_bytes,
        "allocated_peak": allocated,  # torch's CPU allocator, around the write
        "total": saved.total_bytes,
    }
    case["largest_tensor"] = max(p.numel() * p.element_size() for p in reference.parameters())
    return case, model


def shard_on_read_case(ckpt: Path, out: Path, preset: str, layout: str) -> dict:
    """The same load through transformers' shard-on-read, the path of layouts the direct block read does not
    take (FSDP x TP on one dim), forced here by hiding the direct path; the saved plan is reused."""
    from transformers import AutoModelForCausalLM

    import hf_colossal_auto.apply.pretrained.load as pretrained_load
    from hf_colossal_auto import autoparallelize
    from hf_colossal_auto.plan import Plan

    direct = pretrained_load._own_ranges
    pretrained_load._own_ranges = lambda live: None if isinstance(live, DTensor) else direct(live)
    try:
        plan = Plan.load(out / f"plan-{preset}-{layout}.json")
        model = autoparallelize(_meta_model(ckpt / preset), plan=plan, pretrained=ckpt / preset)
    finally:
        pretrained_load._own_ranges = direct
    reference = AutoModelForCausalLM.from_pretrained(ckpt / preset).eval()
    storage, shards = _storage_bytes(model)
    read = model._hf_colossal_auto_load_report.bytes_read
    return {
        "differs": _differs(model, reference),
        "storage_bytes": storage,
        "shard_bytes": shards,
        "read": read,
    }


def accelerator_case(ckpt: Path, out: Path) -> dict:
    """``AutoParallelPlugin(pretrained=...)``: the accelerator applies a saved plan to a meta Llama and loads the
    checkpoint into its shards; ``save_model`` streams the export."""
    from transformers import AutoModelForCausalLM

    from hf_colossal_auto.integrations import AutoParallelAccelerator, AutoParallelPlugin

    directory = ckpt / "tiny-llama"
    plugin = AutoParallelPlugin(pretrained=str(directory), plan_path=str(out / "plan-tiny-llama-tp.json"))
    accelerator = AutoParallelAccelerator(auto_parallel_plugin=plugin, cpu=True)
    model = accelerator.prepare(_meta_model(directory))
    reference = AutoModelForCausalLM.from_pretrained(directory).eval()
    case = {"differs": _differs(model, reference), "sharded": _storage_bytes(model)[0]}
    accelerator.save_model(model, out / "export-accelerate", max_shard_size="200KB")
    return case


SAVE_LAYOUTS = {"ddp": "fsdp", "fsdp": "fsdp", "tp": "tp"}
"""The plans every save line users call is tried under (``save_paths_case``): ``ddp`` is the 2 x 1 plan of
``fsdp`` (from ``load_case``) with DDP on its data-parallel axis."""


def _accelerated(ckpt: Path, out: Path, layout: str):
    """tiny-gpt2 (tied embeddings) built on meta, prepared by an AutoParallelAccelerator under ``layout``'s plan
    (``load_case``'s, passed as plan_path) with the checkpoint's weights, then one SGD step, so that the saved
    weights are not the checkpoint's."""
    from hf_colossal_auto import shard_batch
    from hf_colossal_auto.integrations import AutoParallelAccelerator, AutoParallelPlugin
    from hf_colossal_auto.plan import Plan

    directory = ckpt / "tiny-gpt2"
    plan_path = out / f"plan-save-{layout}.json"
    if dist.get_rank() == 0:
        plan = Plan.load(out / f"plan-tiny-gpt2-{SAVE_LAYOUTS[layout]}.json")
        plan.dp_mode = "ddp" if layout == "ddp" else plan.dp_mode
        plan.save(plan_path)
    dist.barrier()
    plugin = AutoParallelPlugin(pretrained=str(directory), plan_path=str(plan_path))
    accelerator = AutoParallelAccelerator(auto_parallel_plugin=plugin, cpu=True)
    model = accelerator.prepare(_meta_model(directory))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(**shard_batch(batches(model.config)[0], model)).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return accelerator, model


def save_paths_case(ckpt: Path, out: Path, layout: str) -> dict:
    """Every save line of accelerate and transformers users, under ``layout``, into ``out/save-<layout>/``:
    the transformers examples' last line, ``save_pretrained`` on every rank (default arguments, several files),
    with ``state_dict=accelerator.get_state_dict(model)`` and with the model's own DTensor state dict,
    ``accelerator.save_model``, ``torch.save`` of ``get_state_dict`` (``reference.pt``, the test's reference),
    ``accelerator.save`` of the model's state dict on every rank, and ``save_pretrained`` and
    ``accelerator.save`` on the main process only (under a DDP plan they write; under a sharded one they raise
    an error that says to call them on every rank instead of hanging). Returns the eval loss of the trained
    model under the plan and the errors met."""
    from hf_colossal_auto import shard_batch
    from hf_colossal_auto.apply.pretrained import SaveCollectiveError

    accelerator, model = _accelerated(ckpt, out, layout)
    root = out / f"save-{layout}"
    main = accelerator.is_main_process
    with torch.no_grad():
        case: dict = {"eval_loss": _global(model(**shard_batch(batches(model.config)[1], model)).loss)}
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(root / "example", is_main_process=main, save_function=accelerator.save)
    unwrapped.save_pretrained(root / "all-ranks", max_shard_size="200KB")
    state = accelerator.get_state_dict(model)
    unwrapped.save_pretrained(
        root / "state-dict", is_main_process=main, state_dict=state, safe_serialization=False
    )
    if main:
        torch.save(state, root / "reference.pt")
    del state
    unwrapped.save_pretrained(root / "dtensor-state-dict", state_dict=unwrapped.state_dict())
    accelerator.save_model(model, root / "save-model", max_shard_size="200KB")
    accelerator.save(unwrapped.state_dict(), root / "accelerator-save.bin")
    accelerator.wait_for_everyone()
    unwrapped._hf_colossal_auto_timeout_s = 0.5  # how long the lone main process waits before it raises
    if main:
        for name, save in (
            ("main-only", lambda: unwrapped.save_pretrained(root / "main-only")),
            (
                "main-only-accelerator-save",
                lambda: accelerator.save(unwrapped.state_dict(), root / "alone.bin"),
            ),
        ):
            try:
                save()
                case[name] = "saved"
            except SaveCollectiveError as error:
                case[name] = str(error)
    accelerator.wait_for_everyone()
    unwrapped.save_pretrained(root / "after-main-only")  # a failed lone save leaves the next one working
    return case


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> float:
    """One AdamW step on this rank's rows; the global batch's loss (the replicas' mean)."""
    from hf_colossal_auto import shard_batch

    loss = model(**shard_batch(batch, model)).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return _global(loss)


def _global(loss: torch.Tensor) -> float:
    """The mean over ranks: on 2 x 1 each replica's loss is half the batch's (equal token counts), on 1 x 2 the
    ranks agree."""
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / dist.get_world_size()


def elastic(ckpt: Path, out: Path, trained: torch.nn.Module) -> dict:
    """Train the ``tp`` Llama two steps, save DCP, go on two steps; resume under ``fsdp`` and do the same."""
    from hf_colossal_auto import shard_batch
    from hf_colossal_auto.apply.checkpoint import load_checkpoint, save_checkpoint

    data = batches(trained.config)
    opt = torch.optim.AdamW(trained.parameters(), lr=LR)
    for step in range(2):
        _step(trained, opt, data[step])
    save_checkpoint(trained, opt, out / "elastic")
    result = {"tp": {"loss": _step(trained, opt, data[2])}}
    with torch.no_grad():
        result["tp"]["next_loss"] = _global(trained(**shard_batch(data[3], trained)).loss)

    resumed = _planned(ckpt / "tiny-llama", "fsdp")
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
    load_checkpoint(resumed, opt, out / "elastic")
    result["fsdp"] = {"loss": _step(resumed, opt, data[2])}
    with torch.no_grad():
        result["fsdp"]["next_loss"] = _global(resumed(**shard_batch(data[3], resumed)).loss)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    init_gloo(timeout_s=120)
    ckpt, out = Path(args.ckpt), Path(args.out)
    result: dict = {}
    kept = None
    for preset in PRESETS:
        for layout in LAYOUTS:
            case, model = load_case(ckpt, out, preset, layout)
            result[f"{preset} {layout} rank{dist.get_rank()}"] = case
            if preset == "tiny-llama" and layout == "tp":
                kept = model
    for preset, layout in (("tiny-llama", "fsdp"), ("tiny-gpt2", "tp")):
        key = f"{preset} {layout} shard-on-read rank{dist.get_rank()}"
        result[key] = shard_on_read_case(ckpt, out, preset, layout)
    result[f"accelerate rank{dist.get_rank()}"] = accelerator_case(ckpt, out)
    for layout in SAVE_LAYOUTS:
        result[f"save {layout} rank{dist.get_rank()}"] = save_paths_case(ckpt, out, layout)
    result["elastic"] = elastic(ckpt, out, kept)
    merged = {k: v for r in every_rank(result) for k, v in r.items()}
    write_results(merged, str(out / "result.json"), indent=1)
    close_gloo(exit_process=True)


if __name__ == "__main__":
    main()

"""Pieces the multi-process checks (and the in-process tests beside them) share. Scripts in this folder import
it as ``common`` (their folder is on ``sys.path`` under torchrun); tests in ``tests/`` as ``multiproc.common``."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn


def wider_model(preset: str) -> nn.Module:
    """The preset at hidden 256, vocab 2000, seeded, in eval mode (no dropout): wide enough that the solver
    shards activations differently from the tiny presets (hidden-sharded residual streams, vocab-parallel
    heads)."""
    from hf_colossal_auto.models import build_model, load_config

    config = load_config(preset)
    for attr in ("hidden_size", "n_embd"):
        if hasattr(config, attr):
            setattr(config, attr, 256)
    for attr in ("intermediate_size", "n_inner"):
        if getattr(config, attr, None) is not None:
            setattr(config, attr, 1024)
    if hasattr(config, "head_dim"):
        config.head_dim = 256 // config.num_attention_heads
    config.vocab_size = 2000
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    model.eval()
    return model


def wide_mixtral(intermediate_size: int = 1024) -> nn.Module:
    """Tiny Mixtral at hidden 256, intermediate ``intermediate_size``, 8 experts, seeded, on CPU: experts large
    against the tokens of a small batch, where the solver chooses expert parallelism (over tp; over dp from about
    2048 on the static CPU spec, where plain FSDP's gathers of the experts cost more than the expert exchange's
    DTensor ops)."""
    from hf_colossal_auto.models import build_model, load_config

    config = load_config("tiny-mixtral")
    config.hidden_size, config.intermediate_size, config.num_local_experts = 256, intermediate_size, 8
    config.head_dim = config.hidden_size // config.num_attention_heads
    torch.manual_seed(0)
    return build_model(config, device="cpu")


def ddp_reference_loss(model: nn.Module, batch: dict[str, Any], dp: int) -> torch.Tensor:
    """One process on the whole batch, the loss DDP trains on: the mean over ``dp`` replicas (equal row blocks,
    rank order) of each replica's mean loss."""
    per = next(v for v in batch.values() if isinstance(v, torch.Tensor)).shape[0] // dp
    return (
        sum(model(**{k: v[r * per : (r + 1) * per] for k, v in batch.items()}).loss for r in range(dp)) / dp
    )


def plan_at_fraction(
    model: nn.Module,
    batch: dict[str, Any],
    *,
    mesh: tuple[int, int],
    dp_mode: str,
    fraction: float,
    recompute: str,
):
    """A plan on ``mesh`` under a budget of ``fraction`` x the peak of the plan made without recompute and
    without a binding budget (what the memory-budget checks hold a real step to). The batch in one piece
    (``micro_batches=1``): the checks run it so."""
    from hf_colossal_auto.solve.planner import plan_model

    common = dict(
        num_devices=mesh[0] * mesh[1], device="cpu", mesh_shape=mesh, dp_modes=(dp_mode,), micro_batches=1
    )
    free = plan_model(model, batch, memory_budget=1 << 40, recompute="none", **common)
    budget = int(free.peak_memory_bytes * fraction)
    return plan_model(model, batch, memory_budget=budget, recompute=recompute, **common)


def measured_step_peak(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], repeats: int = 3
) -> int:
    """MemTracker's peak (bytes, CPU) of a forward + backward + optimizer step of ``model`` on ``batch``, the lowest
    of ``repeats`` identical steps; run after a warm-up step, so that the optimizer state exists as in every later
    step.

    Why the lowest: gloo's worker thread frees a collective's work object, and with it the tensors it holds, a
    moment *after* the caller's ``wait()`` has returned (the mechanism behind the abort at exit,
    ``hf_colossal_auto/integrations/process_exit.py``). On an oversubscribed machine the worker can be descheduled
    long enough for the step to reach its peak with such a tensor still alive: the peak of the step plus a buffer
    the transport should have released, in about one step in ten on the 2-core CI machine (a 1 MiB backward
    temporary in the recompute check; 164 KiB in the sequence-parallel one). A late release only ever adds to a
    peak, and the steps are otherwise the same to the byte, so the lowest is the step's own."""
    return min(_one_step_peak(model, optimizer, batch) for _ in range(repeats))


def _one_step_peak(model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any]) -> int:
    """MemTracker's peak (bytes, CPU) of one forward + backward + optimizer step."""
    from hf_colossal_auto._torch_compat import MemTracker

    tracker = MemTracker()
    # The batch is in memory during the step (the planner counts it), but was made before the tracker: name it,
    # or only a runtime that happens to view it (DTensor's from_local) gets it counted.
    inputs = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    tracker.track_external(model, optimizer, *inputs)
    with tracker:
        loss = model(**batch).loss
        loss.backward()
        del loss
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def p2p_by_peer(records: list, predicted: dict[str, list[int]], model: nn.Module) -> tuple[dict, dict]:
    """This rank's point-to-point ops of one step by ``op:peer`` (count, bytes): measured (``records`` of
    ``_torch_compat.recording_point_to_point``), and as a pipeline plan's simulated schedule has them
    (``predicted``: its ``solver["point_to_point"]``, ``"src->dst"`` in pp ranks, mapped to the global ranks
    of this rank's pipeline)."""
    import torch.distributed as dist

    from hf_colossal_auto import pipeline_runner

    group = pipeline_runner(model).group
    rank = dist.get_rank()
    measured: dict[str, list[int]] = {}
    for record in records:
        key = f"{record.op}:{record.peer}"
        count, nbytes = measured.get(key, [0, 0])
        measured[key] = [count + 1, nbytes + record.nbytes]
    expected: dict[str, list[int]] = {}
    for pair, (count, nbytes) in predicted.items():
        src, dst = (dist.get_global_rank(group, int(r)) for r in pair.split("->"))
        if rank in (src, dst):
            expected[f"isend:{dst}" if src == rank else f"irecv:{src}"] = [count, nbytes]
    return measured, expected


def step_peaks(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, Any], contexts: list[Any]
) -> list[int]:
    """The peak bytes of each of ``len(contexts)`` forward + backward + optimizer steps of ``model`` on ``batch``, the
    first run right after the optimizer is made: the model's parameters and buffers (distinct storages) plus
    every allocation torch's CPU allocator made since the first step began and had not freed (the profiler's
    memory events), at its most during that step. What persists between steps (optimizer state, a pipeline's
    receive buffers) is thus counted in the later steps, whatever made it. For models ``MemTracker`` cannot
    follow (a pipeline's stages share submodules with the model, which its module tracker refuses); a DTensor
    parameter counts its local shard. Step ``i`` runs inside ``contexts[i]`` (e.g. a recorder of its
    communication)."""
    import json
    import tempfile

    from torch.distributed.tensor import DTensor
    from torch.profiler import ProfilerActivity, profile, record_function

    tensors = [t.to_local() if isinstance(t, DTensor) else t for t in [*model.parameters(), *model.buffers()]]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for i, context in enumerate(contexts):
            with record_function(f"measured step {i}"), context:
                loss = model(**batch).loss
                loss.backward()
                del loss
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            events = json.load(f)["traceEvents"]
    starts = sorted(e["ts"] for e in events if str(e.get("name", "")).startswith("measured step "))
    changes = sorted(
        (e["ts"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0  # CPU
    )
    peaks = [held] * len(contexts)
    for ts, change in changes:
        held += change
        step = sum(ts >= s for s in starts) - 1
        if step >= 0:
            peaks[step] = max(peaks[step], held)
    return peaks


def allocation_peak(fn: Any) -> tuple[Any, int]:
    """``fn()``'s result and the most bytes it had allocated at once beyond what existed before it, by torch's
    CPU allocator: the profiler's memory events (every tensor storage allocated or freed, in order). Measured
    from outside the code under test, independent of anything it reports about itself."""
    import json
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            events = json.load(f)["traceEvents"]
    changes = sorted(
        (e["ts"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0  # CPU
    )
    held = peak = 0
    for _, change in changes:
        held += change
        peak = max(peak, held)
    return result, peak


def accumulating_loop(
    accelerator: Any, model: nn.Module, optimizer: Any, loader: Any
) -> tuple[list, list, list, Any]:
    """accelerate's documented loop with gradient accumulation and clipping, as users write it: (each batch's
    loss, the clip norm of each synchronised step, each batch's first-token column, the last batch)."""
    losses, norms, seen = [], [], []
    batch = None
    for batch in loader:
        seen.append(batch["input_ids"][:, 0].tolist())
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses, norms, seen, batch


@contextlib.contextmanager
def all_gathers() -> Iterator[list[int]]:
    """The elements of every ``dist.all_gather_into_tensor`` output inside the block, in call order (context
    parallelism's K/V gathers, a lazy output's read tag and its gathered field)."""
    real = dist.all_gather_into_tensor
    seen: list[int] = []

    def counting(output, *args, **kwargs):
        seen.append(output.numel())
        return real(output, *args, **kwargs)

    with mock.patch.object(dist, "all_gather_into_tensor", counting):
        yield seen


def out_argument() -> str:
    """The ``--out`` path of a check that takes no other argument (where it writes its results)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    return parser.parse_args().out


def init_gloo(timeout_s: float | None = None) -> None:
    """The gloo process group that torchrun's environment describes. ``timeout_s`` bounds each collective, so that
    a rank that died or diverged fails the check in that time instead of hanging it (None: torch's default)."""
    if timeout_s is None:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))


def every_rank(obj: Any) -> list[Any]:
    """``obj`` from every rank, in rank order, on every rank (``dist.all_gather_object``)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def write_results(results: Any, out: str, *, per_rank: bool = False, indent: int | None = None) -> None:
    """``results`` as JSON: rank 0's to ``out``, or with ``per_rank`` each rank's own to ``{out}.rank{r}`` (the
    names the tests read)."""
    if per_rank:
        out = f"{out}.rank{dist.get_rank()}"
    elif dist.get_rank() != 0:
        return
    with open(out, "w") as f:
        json.dump(results, f, indent=indent)


def close_gloo(*, exit_process: bool = False) -> None:
    """Tear the group down in the order gloo needs: every rank at a barrier (the caller has freed its models and
    optimizers already), then ``destroy_process_group``. ``exit_process`` then ends the process with
    ``os._exit(0)``, skipping interpreter teardown, where gloo's threads can otherwise hang at exit."""
    dist.barrier()
    dist.destroy_process_group()
    if exit_process:
        os._exit(0)


def write_every_rank_and_close(results: Any, out: str) -> None:
    """Every rank's ``results`` in one JSON list written by rank 0, then the group torn down in order."""
    write_results(every_rank(results), out, indent=1)
    close_gloo()

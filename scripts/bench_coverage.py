"""Coverage sweep: every architecture of transformers' causal-LM, masked-LM and seq2seq-LM auto mappings, built
from a small config, planned and trained one step on 2 gloo ranks under a forced mesh, against one process.

    python scripts/bench_coverage.py --meshes 1x2,2x1 --json docs/measurements/coverage.json [--archs falcon,gpt2]

The driver launches one ``torch.distributed.run`` per mesh (2 ranks) running this file with ``--worker``; the
worker loops over the architectures, each in try/except, and rank 0 appends one JSON line per architecture and
mesh to a progress file. A launch that dies or stops making progress (a hang in a collective) is ended, the
architecture it was on is recorded as crashed, and a new launch goes on with the rest.

Per architecture: the model class of the mapping, its config class's defaults shrunk through the common
attribute names (:func:`small_config`: hidden 64, 2 layers, 4 heads, 2 kv heads, intermediate 128, vocab 256, 4
experts of which 2 per token...), fp32, eval mode (no dropout), seeded. One process trains a copy on the whole
global batch (the data-parallel reference: the mean of the replicas' mean losses); the ranks plan with
``autoparallelize(model, batch, mesh_shape=mesh, device="cpu", micro_batches=1)``, train one step (SGD, so that
the updated weights are the gradients' image) and compare loss, every gradient and every updated weight with the
reference (within 1e-5 + 1e-5 x the tensor's largest value).

Outcomes: ``exact``; ``refused`` (planning or applying raised before any training: the message must name the
cause); ``crashed`` (forward, backward or the optimizer step raised, or the launch died); ``wrong`` (a
difference above the tolerance); ``skipped`` (the architecture does not run in one process from a small config
and ids alone: it needs pixel values, audio, an external package... — the reason recorded).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 1e-5
"""Absolute tolerance on loss, gradients and updated weights, beyond RTOL of each tensor's largest value."""
RTOL = 1e-5
BATCH, SEQ = 4, 16
VOCAB = 256
INPUT_VOCAB = 240
"""Input and label ids are drawn below this: the special ids (image, audio tokens...) sit above it, so that a
text batch never holds a token that asks a multimodal model for pixel values."""
LR = 0.1
COLLECTIVE_TIMEOUT_S = 1800
"""Seconds a rank waits for its peer (the worker's ``--collective-timeout``): autoparallelize's 300 s default
would end an architecture whose planning takes longer on a shared box."""

# Common attribute names -> the small value. Set only where the default config has the attribute.
_HIDDEN = (
    "hidden_size",
    "d_model",
    "n_embd",
    "embed_dim",
    "emb_dim",
    "word_embed_proj_dim",
    "embedding_size",
)
_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "num_layers",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
)
_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
)
_SMALL = {
    **dict.fromkeys(_HIDDEN, 64),
    **dict.fromkeys(_LAYERS, 2),
    **dict.fromkeys(_HEADS, 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "d_kv", "d_head", "kv_channels", "attention_head_size"), 16),
    **dict.fromkeys(
        (
            "intermediate_size",
            "ffn_dim",
            "d_ff",
            "n_inner",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "ffn_hidden_size",
            "d_inner",
        ),
        128,
    ),
    **dict.fromkeys(
        ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size"), 64
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "num_experts_per_token", "moe_topk"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "n_group", "topk_group", "n_groups"), 1),
    "vocab_size": VOCAB,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "index_head_dim": 16,
    "index_n_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mamba_d_state": 16,
    "mamba_d_head": 16,
    "mamba_n_heads": 8,
    "state_size": 16,
    "time_step_rank": 8,
}
_DROPOUT_WORDS = (
    "dropout",
    "drop_rate",
    "dropout_rate",
    "layerdrop",
    "attn_pdrop",
    "resid_pdrop",
    "embd_pdrop",
)
VARIANTS = {"falcon+new_decoder_architecture": ("falcon", {"new_decoder_architecture": True})}
"""Architectures whose non-default branch matters to the runtime, swept as their own entries."""


FAMILY_FIXES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba2": {"num_heads": 8, "head_dim": 16},
    "esmc": {"num_key_value_heads": 4},
    "dots3_note_text": {"num_key_value_heads": 4},
    "zaya": {"num_experts_per_tok": 1},
}
"""Settings a family's small config needs beyond the common names (its own consistency rules)."""


def _shrunk_kwargs(defaults: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments that shrink a config whose ``to_dict()`` is ``defaults``: the common sizes (also
    where the default is None: a size derived at full scale), per-layer lists cut to the small depth, dropout
    off, and every special token id moved above :data:`INPUT_VOCAB` (distinct while there are few enough)."""
    out: dict[str, Any] = {}
    for key, small in _SMALL.items():
        value = defaults.get(key, ...)
        if value is None or _is_id(value):
            out[key] = small
        elif isinstance(value, list) and value and all(_is_id(v) for v in value):
            out[key] = [small] * len(value)  # a size per layer (Gemma3n's intermediate sizes)
    if "qk_rope_head_dim" in defaults or not ({"hidden_size", "d_model"} & out.keys()):
        out.pop("head_dim", None)  # multi-head latent attention derives it; so do configs without a width
    if isinstance(defaults.get("rotary_dim"), int):
        out["rotary_dim"] = 8  # GPT-J, CodeGen: rotary dims within the small head
    special = 0
    for key, value in defaults.items():
        if isinstance(value, float) and any(word in key for word in _DROPOUT_WORDS):
            out[key] = 0.0
        elif _is_id(value) and key.endswith(("token_id", "token_index")) and "vocab_size" in defaults:
            out[key] = VOCAB - 1 - special % (VOCAB - INPUT_VOCAB)
            special += 1
    for depth_key in _LAYERS:
        old = defaults.get(depth_key)
        if _is_id(old) and depth_key in out and old != out[depth_key]:
            for key, value in defaults.items():
                if isinstance(value, list) and len(value) == old:
                    out[key] = (out.get(key) or value)[: out[depth_key]]
    if defaults.get("is_encoder_decoder") and defaults.get("decoder_start_token_id") is None:
        out["decoder_start_token_id"] = out.get("pad_token_id", defaults.get("pad_token_id") or 0)
    return out


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def small_config(class_name: str, model_type: str, overrides: dict[str, Any] | None = None):
    """The config class of ``class_name`` with its defaults shrunk (sub-configs too); the family's fixes and
    ``overrides`` last."""
    import transformers
    from transformers import CONFIG_MAPPING

    cls = getattr(transformers, class_name).config_class
    defaults = cls().to_dict()
    kwargs = _shrunk_kwargs(defaults)
    for key, value in defaults.items():
        if isinstance(value, dict) and value.get("model_type") in CONFIG_MAPPING:
            kwargs[key] = {**value, **_shrunk_kwargs(value)}
    kwargs.update(FAMILY_FIXES.get(model_type, {}))
    kwargs.update(overrides or {})
    config = cls(**kwargs)
    config.use_cache = False
    return config


def architectures() -> list[tuple[str, str, str]]:
    """``(name, model_type, class name)`` of every entry of the three mappings (one per class), then the
    variants."""
    from transformers.models.auto import modeling_auto

    seen: dict[str, tuple[str, str, str]] = {}
    for mapping in (
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
    ):
        for model_type, class_name in mapping.items():
            class_name = class_name[0] if isinstance(class_name, tuple) else class_name
            entry = (f"{model_type}:{class_name}", model_type, class_name)
            # a class several model types map to (Llama's): under the type of its own config class
            if class_name not in seen or _own_type(class_name) == model_type:
                seen[class_name] = entry
    out = sorted(seen.values())
    for name, (model_type, _) in VARIANTS.items():
        class_name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
        out.append((f"{name}:{class_name}", model_type, class_name))
    return out


def _own_type(class_name: str) -> str | None:
    import transformers

    cls = getattr(transformers, class_name, None)
    return getattr(getattr(cls, "config_class", None), "model_type", None)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:600]


def _build(name: str, model_type: str, class_name: str):
    """The seeded small model (eval mode) and its global batch, or raise."""
    import torch
    import transformers

    base = name.split(":")[0]
    overrides = VARIANTS[base][1] if base in VARIANTS else {}
    config = small_config(class_name, model_type, overrides)
    cls = getattr(transformers, class_name)
    torch.manual_seed(0)
    attn = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    model = cls._from_config(config, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    return model, _batch(model)


def _batch(model) -> dict[str, Any]:
    """Ids below :data:`INPUT_VOCAB`, a full mask and labels for the model class's task (causal: the ids;
    masked: 15 % of positions; seq2seq: targets a quarter as long), plus token type ids where the config has
    them."""
    import torch

    from hf_colossal_auto.models import MLM_PROBABILITY, task_of

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, INPUT_VOCAB, (BATCH, SEQ), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "type_vocab_size", 0):
        batch["token_type_ids"] = torch.zeros_like(ids)
    try:
        task = task_of(model)
    except ValueError:
        task = "causal-lm"
    if task == "masked-lm":
        labelled = max(1, round(MLM_PROBABILITY * SEQ))
        positions = torch.rand((BATCH, SEQ), generator=generator).argsort(dim=1)[:, :labelled]
        batch["labels"] = torch.full_like(ids, -100).scatter_(1, positions, ids.gather(1, positions))
    elif task == "seq2seq-lm":
        batch["labels"] = torch.randint(0, INPUT_VOCAB, (BATCH, SEQ // 4), generator=generator)
    else:
        batch["labels"] = ids.clone()
    return batch


_EXTRA_INPUTS = ("pixel_values", "input_features", "input_values", "audio_values", "input_audio_features")


def _extra_inputs(class_name: str) -> list[str]:
    """The non-text inputs the class's forward takes (pixel values, audio features...)."""
    import inspect

    import transformers

    params = inspect.signature(getattr(transformers, class_name).forward).parameters
    return [name for name in _EXTRA_INPUTS if name in params]


def _reference(model, batch: dict[str, Any], dp: int) -> tuple[float, dict, dict]:
    """One process: the data-parallel loss (mean of the replicas' mean losses), the gradients, and the weights
    after one SGD step."""
    import torch

    reference = copy.deepcopy(model)
    per = BATCH // dp
    loss = (
        sum(reference(**{k: v[r * per : (r + 1) * per] for k, v in batch.items()}).loss for r in range(dp))
        / dp
    )
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    torch.optim.SGD(reference.parameters(), lr=LR).step()
    weights = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return float(loss), grads, weights


def _full(value):
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _gap(got: Any, want: Any) -> float:
    """How far ``got`` is outside ``want``'s tolerance: ``max(|got - want|) - RTOL * max(|want|)``, at least 0;
    within tolerance when at most :data:`TOLERANCE`. Relative to the tensor's largest value, not elementwise:
    an entry summed from large terms that cancel (RWKV's embedding gradient, entries up to 85) carries fp32
    rounding of its terms' size — one process in fp32 is itself 8e-5 off the fp64 gradient there — while a
    missing or doubled reduction is off by the size of the values."""
    import torch

    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    if got.numel() == 0:  # an empty parameter (MobileBERT's at these widths): nothing to differ
        return 0.0
    return max(0.0, float((got - want).abs().max() - RTOL * want.abs().max()))


def _grad_gap(model, grads: dict) -> tuple[float, str]:
    """The largest gradient gap (:func:`_gap`) and its parameter's name; a parameter one side leaves without a
    gradient counts its other side's largest value (wrong unless that is all zeros)."""
    worst, where = 0.0, ""
    for name, param in model.named_parameters():
        want = grads.get(name)
        got = None if param.grad is None else _full(param.grad)
        if (want is None) != (got is None):
            present = want if got is None else got
            gap = float(present.abs().max()) if present.numel() else 0.0
        else:
            gap = 0.0 if want is None else _gap(got, want)
        if gap > worst:
            worst, where = gap, name
    return worst, where


def _weight_gap(model, weights: dict) -> tuple[float, str]:
    """The largest gap (:func:`_gap`) between an updated weight and one process's, and its name."""
    worst, where = 0.0, ""
    for name, param in model.named_parameters():
        gap = _gap(_full(param.detach()), weights[name])
        if gap > worst:
            worst, where = gap, name
    return worst, where


def run_on_mesh(model, batch: dict[str, Any], mesh: tuple[int, int], reference: tuple) -> dict[str, Any]:
    """Plan, apply and train one step of a copy of ``model`` on ``mesh``; the outcome against one process's
    ``reference`` (:func:`_reference` at this mesh's data-parallel size)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from hf_colossal_auto import autoparallelize

    dp, tp = mesh
    rank = dist.get_rank()
    ref_loss, grads, weights = reference
    work = copy.deepcopy(model)
    per = BATCH // dp
    replica = rank // tp
    local = {k: v[replica * per : (replica + 1) * per] for k, v in batch.items()}
    record: dict[str, Any] = {"mesh": f"{dp}x{tp}"}
    started = time.perf_counter()
    try:
        # the collective timeout stays the launch's: a slow plan on rank 0 is not a rank that stopped answering
        autoparallelize(
            work, local, mesh_shape=mesh, device="cpu", micro_batches=1, timeout=COLLECTIVE_TIMEOUT_S
        )
    except Exception as exc:  # noqa: BLE001 - every refusal is an outcome to record
        return {**record, "outcome": "refused", "reason": _first_line(exc)}
    plan = work._hf_colossal_auto_plan
    record["plan_s"] = round(time.perf_counter() - started, 2)
    record["dp_mode"] = plan.dp_mode
    record["sharded_params"] = sum(
        1
        for p in work.parameters()
        if isinstance(p, DTensor) and not all(q.is_replicate() for q in p.placements)
    )
    record["replicated_ops"] = list(plan.replicated_ops)
    try:
        opt = torch.optim.SGD(work.parameters(), lr=LR)
        out = work(**local)
        out.loss.backward()
        losses = [None] * dist.get_world_size()
        dist.all_gather_object(losses, float(out.loss))
        loss = sum(losses[r * tp] for r in range(dp)) / dp
        loss_gap = _gap(loss, ref_loss)
        grad_gap, grad_at = _grad_gap(work, grads)
        opt.step()
        weight_gap, weight_at = _weight_gap(work, weights)
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return {**record, "outcome": "crashed", "reason": _first_line(exc)}
    record.update(loss_gap=loss_gap, grad_gap=grad_gap, weight_gap=weight_gap)
    if max(loss_gap, grad_gap, weight_gap) > TOLERANCE:
        at = grad_at if grad_gap > TOLERANCE else weight_at
        reason = (
            f"loss gap {loss_gap:.2e}, gradient gap {grad_gap:.2e}, weight gap {weight_gap:.2e} (worst: {at})"
        )
        return {**record, "outcome": "wrong", "reason": reason}
    return {**record, "outcome": "exact", "reason": ""}


def run_architecture(
    name: str, model_type: str, class_name: str, meshes: list[tuple[int, int]]
) -> list[dict]:
    """Every mesh's record for one architecture (one ``skipped`` record when it does not run in one process)."""
    import torch

    head = {"architecture": name, "model_type": model_type, "class": class_name}
    try:
        model, batch = _build(name, model_type, class_name)
        with torch.no_grad():
            out = model(**batch)
        if getattr(out, "loss", None) is None:
            raise ValueError("the model returns no loss from input_ids and labels")
        references = {dp: _reference(model, batch, dp) for dp in {dp for dp, _ in meshes}}
    except Exception as exc:  # noqa: BLE001
        reason = _first_line(exc)
        needs = _extra_inputs(class_name)
        if needs:
            reason = f"does not train from ids alone (its forward takes {', '.join(needs)}): {reason}"
        return [{**head, "mesh": f"{dp}x{tp}", "outcome": "skipped", "reason": reason} for dp, tp in meshes]
    head["params"] = sum(p.numel() for p in model.parameters())
    return [{**head, **run_on_mesh(model, batch, mesh, references[mesh[0]])} for mesh in meshes]


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: every architecture of ``--archs`` on every mesh of ``--meshes``; rank 0 appends a
    ``started`` line, then the records, to ``--progress`` as it goes."""
    import logging

    import torch
    import torch.distributed as dist
    import transformers

    transformers.logging.set_verbosity_error()
    logging.getLogger("hf_colossal_auto").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    global COLLECTIVE_TIMEOUT_S
    COLLECTIVE_TIMEOUT_S = args.collective_timeout
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.collective_timeout))
    rank = dist.get_rank()
    meshes = [tuple(int(x) for x in m.split("x")) for m in args.meshes.split(",")]
    wanted = set(args.archs.split(",")) if args.archs else None
    progress = Path(args.progress)
    for name, model_type, class_name in architectures():
        if wanted is not None and name not in wanted and name.split(":")[0] not in wanted:
            continue
        if rank == 0:
            with progress.open("a") as f:
                f.write(json.dumps({"started": name}) + "\n")
        started = time.perf_counter()
        records = run_architecture(name, model_type, class_name, meshes)
        for record in records:  # every rank's own outcome in the launch's log (a rank that parts ways shows)
            print(
                f"rank {rank}: {name} {record['mesh']} {record['outcome']} {record.get('reason', '')[:300]}"
            )
        dist.barrier()
        if rank == 0:
            with progress.open("a") as f:
                for record in records:
                    record["seconds"] = round(time.perf_counter() - started, 1)
                    f.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _read_progress(path: Path) -> tuple[list[dict], str | None]:
    """The records so far, and the architecture a launch started without finishing (None if none)."""
    records, started = [], None
    if not path.exists():
        return records, started
    for line in path.read_text().splitlines():
        item = json.loads(line)
        if "started" in item:
            started = item["started"]
        else:
            records.append(item)
            if item["architecture"] == started:
                started = None
    return records, started


def _launch(mesh: str, archs: list[str], progress: Path, stall_s: float) -> str:
    """One torchrun of the worker over ``archs`` on ``mesh``, ended when the progress file stalls for
    ``stall_s`` seconds; the tail of its output."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_COLOSSAL_AUTO_NO_CALIBRATE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": str(ROOT),
    }
    log = progress.with_suffix(".log")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
        "--meshes", mesh, "--archs", ",".join(archs), "--progress", str(progress),
        "--collective-timeout", str(int(stall_s)),
    ]  # fmt: skip
    with log.open("a") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        last, size = time.monotonic(), -1
        while proc.poll() is None:
            time.sleep(2)
            now = progress.stat().st_size if progress.exists() else 0
            if now != size:
                last, size = time.monotonic(), now
            elif time.monotonic() - last > stall_s:
                _end(proc)
                break
    return log.read_text()[-2000:]


def _end(proc: subprocess.Popen) -> None:
    """End the launch this driver started: SIGTERM to torchrun, which passes it to its workers (they run in
    sessions of their own), then SIGKILL to its group if it has not ended within 30 s."""
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def sweep(mesh: str, archs: list[str], workdir: Path, stall_s: float) -> list[dict]:
    """Every architecture on ``mesh``, relaunching past an architecture that killed or hung a launch."""
    progress = workdir / f"progress_{mesh}.jsonl"
    progress.unlink(missing_ok=True)
    records: list[dict] = []
    while True:
        done = {r["architecture"] for r in records}
        remaining = [a for a in archs if a not in done]
        if not remaining:
            return records
        tail = _launch(mesh, remaining, progress, stall_s)
        records, started = _read_progress(progress)
        done_now = {r["architecture"] for r in records}
        if started is None and all(a in done_now for a in remaining):
            return records
        lost = started or next(a for a in remaining if a not in done_now)
        last_line = next((line for line in reversed(tail.splitlines()) if "Error" in line), tail[-300:])
        record = {"architecture": lost, "mesh": mesh, "outcome": "crashed",
                  "reason": f"the launch died or hung on it: {' '.join(last_line.split())[:400]}"}  # fmt: skip
        with progress.open("a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)


def markdown(records: list[dict]) -> str:
    """The results table: one row per architecture, one outcome column per mesh."""
    meshes = sorted({r["mesh"] for r in records}, reverse=True)
    by_arch: dict[str, dict[str, dict]] = {}
    for r in records:
        by_arch.setdefault(r["architecture"], {})[r["mesh"]] = r
    lines = ["| architecture | " + " | ".join(meshes) + " | reason |", "|---" * (len(meshes) + 2) + "|"]
    for arch in sorted(by_arch):
        row = by_arch[arch]
        reasons = sorted({r["reason"] for r in row.values() if r.get("reason")})
        text = "; ".join(r[:300] for r in reasons).replace("|", "\\|")
        lines.append(
            f"| {arch} | " + " | ".join(row.get(m, {}).get("outcome", "-") for m in meshes) + f" | {text} |"
        )
    return "\n".join(lines)


def summary(records: list[dict]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in records:
        counts = out.setdefault(r["mesh"], {})
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="1x2,2x1")
    parser.add_argument("--archs", default="", help="names or model types, comma-separated (default: all)")
    parser.add_argument("--json", default=None, help="write the records and the summary here")
    parser.add_argument("--markdown", default=None, help="write the results table here")
    parser.add_argument("--workdir", default="/tmp/bench_coverage")
    parser.add_argument("--stall-s", type=float, default=1200.0, help="end a launch silent this long")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--progress", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--collective-timeout", type=int, default=300, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    sys.path.insert(0, str(ROOT))
    wanted = set(args.archs.split(",")) if args.archs else None
    archs = [n for n, t, _ in architectures() if wanted is None or n in wanted or n.split(":")[0] in wanted]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    records = []
    for mesh in args.meshes.split(","):
        records += sweep(mesh, archs, workdir, args.stall_s)
    result = {
        "command": " ".join(sys.argv),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, 2 gloo ranks (CPU)",
        "date": datetime.date.today().isoformat(),
        "wall_s": round(time.time() - started),
        "summary": summary(records),
        "records": records,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(records) + "\n")
    print(json.dumps(result["summary"]))


if __name__ == "__main__":
    main()

"""Benchmark pretrained checkpoints at full size (issue 13): sharded load and streaming export on 2 CPU ranks
against ``from_pretrained`` + ``save_pretrained`` in one process.

A ~1.1B-parameter Llama (TinyLlama's shape: hidden 2048, 22 layers, 32 heads, 4 KV heads, vocab 32000) is built
from its config with random weights and saved locally in bf16 (``save_pretrained``, ``--max-shard-size``
files). Then, each in its own process so that peak RSS is its own:

* ``single``: ``AutoModelForCausalLM.from_pretrained(ckpt, dtype=bf16)`` then ``save_pretrained(export)``;
* ``ranks`` (``torch.distributed.run``, 2 gloo ranks): the model built on ``meta``, a 1 x 2 Megatron plan
  (made beforehand in another process, not timed) applied with ``pretrained=ckpt`` (each rank reads its slices),
  then the streaming ``hf_colossal_auto.save_pretrained(export)``.

Reported: wall time of load and of export, peak RSS (``ru_maxrss``) of each process and its RSS after imports,
and the ratios ranks / single (targets: peak RSS <= 0.6 x, time <= 1.5 x). The two-rank export is checked
tensor by tensor against the checkpoint (bit-identical, one tensor at a time).

Usage::

    python scripts/bench_checkpoint.py [--workdir DIR] [--max-shard-size 500MB] [--json out.json] [--layers 22]
        [--shard-vocab]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def _rss_now() -> int:
    """Resident bytes of this process now (/proc/self/status VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_rss() -> int:
    """The most resident bytes this process has had (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config(layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(**{**CONFIG, "num_hidden_layers": layers})


def make(workdir: Path, layers: int, max_shard_size: str) -> dict:
    """The bf16 checkpoint, from the config with random weights (skipped when already there)."""
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = workdir / "ckpt"
    if (ckpt / "config.json").is_file():
        return {"skipped": True}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(layers), dtype=torch.bfloat16)
    model.save_pretrained(ckpt, max_shard_size=max_shard_size)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def single(workdir: Path, max_shard_size: str) -> dict:
    """One process: from_pretrained, then save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    base = _rss_now()
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(workdir / "ckpt", dtype=torch.bfloat16)
    loaded = time.perf_counter()
    peak_after_load = _peak_rss()
    model.save_pretrained(workdir / "export-single", max_shard_size=max_shard_size)
    saved = time.perf_counter()
    return {
        "load_s": loaded - start,
        "export_s": saved - loaded,
        "rss_after_imports": base,
        "peak_rss": _peak_rss(),
        "peak_rss_after_load": peak_after_load,
    }


def plan(workdir: Path, shard_vocab: bool) -> dict:
    """The 1 x 2 Megatron plan for the meta model (in its own process: planning is not what is measured);
    ``shard_vocab``: the embedding and the LM head split over the vocabulary too, as Megatron-LM splits them
    (our Megatron baseline keeps them replicated), for what a rank holds when every matrix is sharded."""
    import torch
    from transformers import AutoModelForCausalLM

    from hf_colossal_auto.models import make_example_inputs
    from hf_colossal_auto.solve.planner import evaluate_plan

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config_of(workdir), dtype=torch.bfloat16)
    batch = make_example_inputs(model, 2, 128, device="meta")
    made = evaluate_plan(model, batch, "megatron", num_devices=2, device="cpu", mesh_shape=(1, 2)).plan
    if shard_vocab:
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            made.param_placements[name] = ["R", "S0"]
    made.save(workdir / "plan.json")
    return {"sharded": sum(1 for p in made.param_placements.values() if p[-1] != "R")}


def _config_of(workdir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(workdir / "ckpt")


def ranks(workdir: Path, max_shard_size: str) -> dict | None:
    """Under torchrun: meta model, plan applied with pretrained=, streaming export; rank 0 returns all ranks'."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from hf_colossal_auto import save_pretrained
    from hf_colossal_auto.apply import apply_plan
    from hf_colossal_auto.plan import Plan

    dist.init_process_group("gloo")
    base = _rss_now()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config_of(workdir), dtype=torch.bfloat16)
    dist.barrier()
    start = time.perf_counter()
    apply_plan(model, Plan.load(workdir / "plan.json"), pretrained=workdir / "ckpt")
    dist.barrier()
    loaded = time.perf_counter()
    peak_after_load = _peak_rss()
    save_pretrained(model, workdir / "export-ranks", max_shard_size=max_shard_size)
    saved = time.perf_counter()
    report = model._hf_colossal_auto_load_report
    mine = {
        "load_s": loaded - start,
        "export_s": saved - loaded,
        "rss_after_imports": base,
        "peak_rss": _peak_rss(),
        "peak_rss_after_load": peak_after_load,
        "bytes_read": report.bytes_read,
        "shard_bytes": report.local_bytes,
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"ranks": everyone} if rank == 0 else None


def verify(workdir: Path) -> dict:
    """The two-rank export against the checkpoint, tensor by tensor (one in memory at a time)."""
    import torch
    from safetensors import safe_open

    def index(directory: Path) -> dict[str, Path]:
        found = {}
        for file in directory.glob("*.safetensors"):
            with safe_open(str(file), framework="pt") as f:
                found.update(dict.fromkeys(f.keys(), file))  # noqa: SIM118 - not iterable
        return found

    want, got = index(workdir / "ckpt"), index(workdir / "export-ranks")
    differ = [k for k in want if k not in got]
    for key, file in want.items():
        if key not in got:
            continue
        with safe_open(str(file), framework="pt") as a, safe_open(str(got[key]), framework="pt") as b:
            if not torch.equal(a.get_tensor(key), b.get_tensor(key)):
                differ.append(key)
    return {
        "tensors": len(want),
        "differ": differ,
        "files": len(list((workdir / "export-ranks").glob("*.safetensors"))),
    }


def _run(args: list[str], torchrun: bool = False) -> dict:
    """One phase in its own process(es); its JSON result from the last line of stdout. Dirty pages of the
    previous phase are flushed first (``os.sync``), so that no phase's writes slow the next one's I/O."""
    os.sync()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["HF_COLOSSAL_AUTO_NO_CALIBRATE"] = "1"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd = [*launcher, __file__, *args] if torchrun else [sys.executable, __file__, *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :])


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _table(single_result: dict, rank_results: list[dict]) -> str:
    rows = [("one process (from_pretrained + save_pretrained)", single_result)] + [
        (f"rank {i} of 2 (1 x 2 TP, pretrained= + streaming export)", r) for i, r in enumerate(rank_results)
    ]
    out = [
        "| process | load | export | load + export | peak RSS | RSS after imports |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in rows:
        total = r["load_s"] + r["export_s"]
        out.append(
            f"| {name} | {r['load_s']:.1f} s | {r['export_s']:.1f} s | {total:.1f} s | {_gib(r['peak_rss'])} | "
            f"{_gib(r['rss_after_imports'])} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/hf_colossal_auto_bench_checkpoint")
    parser.add_argument("--max-shard-size", default="500MB")
    parser.add_argument("--layers", type=int, default=CONFIG["num_hidden_layers"])
    parser.add_argument("--json")
    parser.add_argument("--shard-vocab", action="store_true", help="split the embedding and LM head too")
    parser.add_argument(
        "--phase", choices=["make", "single", "plan", "ranks", "verify"], help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    workdir = Path(args.workdir)
    if args.phase is not None:
        import transformers

        transformers.logging.set_verbosity_error()
        phases = {
            "make": lambda: make(workdir, args.layers, args.max_shard_size),
            "single": lambda: single(workdir, args.max_shard_size),
            "plan": lambda: plan(workdir, args.shard_vocab),
            "ranks": lambda: ranks(workdir, args.max_shard_size),
            "verify": lambda: verify(workdir),
        }
        result = phases[args.phase]()
        if result is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return
    workdir.mkdir(parents=True, exist_ok=True)
    common = [
        "--workdir",
        str(workdir),
        "--max-shard-size",
        args.max_shard_size,
        "--layers",
        str(args.layers),
    ]
    made = _run([*common, "--phase", "make"])
    single_result = _run([*common, "--phase", "single"])
    _run([*common, "--phase", "plan", *(["--shard-vocab"] if args.shard_vocab else [])])
    rank_results = _run([*common, "--phase", "ranks"], torchrun=True)["ranks"]
    checked = _run([*common, "--phase", "verify"])
    worst_rss = max(r["peak_rss"] for r in rank_results)
    worst_time = max(r["load_s"] + r["export_s"] for r in rank_results)
    summary = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "made": made,
        "single": single_result,
        "ranks": rank_results,
        "verify": checked,
        "rss_ratio": worst_rss / single_result["peak_rss"],
        "time_ratio": worst_time / (single_result["load_s"] + single_result["export_s"]),
    }
    print(_table(single_result, rank_results))
    print(
        f"\nper-rank peak RSS / one process: {summary['rss_ratio']:.2f} (target <= 0.6); "
        f"time: {summary['time_ratio']:.2f} (target <= 1.5); export check: {checked}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

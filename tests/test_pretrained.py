"""HF safetensors checkpoints: loaded into (sharded) models without a full copy, exported streaming, and DCP
state resumed under another plan or world size.

One process: a model on ``meta`` loaded from a sharded checkpoint equals ``from_pretrained`` (Llama; GPT-2 with
tied embeddings), dtypes are converted both ways, transformers' load-time renames apply, keys that do not fit
are errors naming them, and the streaming export round-trips. Two gloo ranks, one launch
(``multiproc/check_pretrained.py``): the same under a tensor-parallel and an FSDP plan with each rank's
parameter bytes measured, the exports, DCP state saved under 1 x 2 TP resumed under 2 x 1 FSDP and in one
process, and every save line of accelerate and transformers users under DDP, FSDP and TP plans.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torchrun_launch import run_torchrun
from transformers import AutoConfig, AutoModelForCausalLM

from hf_colossal_auto.apply.pretrained import PretrainedLoadError, load_pretrained, save_pretrained
from hf_colossal_auto.models import build_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multiproc"))
PRESETS = ("tiny-llama", "tiny-gpt2")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> Path:
    """Tiny Llama and GPT-2 checkpoints (random weights, seed 0), each written into several files."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("checkpoints")
    for preset in PRESETS:
        torch.manual_seed(0)
        build_model(preset, device="cpu").save_pretrained(root / preset, max_shard_size="60KB")
        assert len(list((root / preset).glob("*.safetensors"))) > 3
    return root


def _on_meta(directory: Path, dtype: torch.dtype | None = None) -> torch.nn.Module:
    config = AutoConfig.from_pretrained(directory)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _assert_same(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    """Every parameter and buffer bit-identical (dtype included)."""
    got = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    want = dict(reference.named_parameters(remove_duplicate=False)) | dict(reference.named_buffers())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert torch.equal(got[name].detach(), value.detach()), name


@pytest.mark.parametrize("preset", PRESETS)
def test_meta_model_loads_like_from_pretrained(checkpoints, preset):
    """Built on meta and loaded: the values, buffers (rotary tables from the model's init) and ties of
    from_pretrained; every checkpoint byte read once."""
    model = _on_meta(checkpoints / preset)
    report = load_pretrained(model, checkpoints / preset)
    reference = AutoModelForCausalLM.from_pretrained(checkpoints / preset)
    _assert_same(model, reference)
    tied = model.lm_head.weight is model.get_input_embeddings().weight
    assert tied == (preset == "tiny-gpt2")
    assert report.bytes_read == report.checkpoint_bytes
    assert not report.missing and not report.unexpected


def test_dtype_converted_both_ways(checkpoints, tmp_path):
    """A bf16 checkpoint into an fp32 model and an fp32 checkpoint into a bf16 model: from_pretrained's values."""
    source = checkpoints / "tiny-llama"
    AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(tmp_path / "bf16")
    for directory, dtype in ((tmp_path / "bf16", torch.float32), (source, torch.bfloat16)):
        model = _on_meta(directory, dtype)
        load_pretrained(model, directory)
        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        assert model.model.embed_tokens.weight.dtype == dtype
        _assert_same(model, reference)


def test_plugin_setting(monkeypatch):
    """``AutoParallelPlugin.pretrained`` from the constructor or ``HF_COLOSSAL_AUTO_PRETRAINED``."""
    from hf_colossal_auto.integrations import AutoParallelPlugin

    for key in [
        k for k in os.environ if k.startswith("HF_COLOSSAL_AUTO_") and not k.endswith("NO_CALIBRATE")
    ]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HF_COLOSSAL_AUTO_PRETRAINED", "/checkpoints/llama")
    assert AutoParallelPlugin().pretrained == "/checkpoints/llama"
    assert AutoParallelPlugin(pretrained="here").pretrained == "here"


def _rewrite(directory: Path, out: Path, edit) -> Path:
    """A one-file copy of a checkpoint whose state dict ``edit`` changed."""
    out.mkdir()
    state = {}
    for file in directory.glob("*.safetensors"):
        state.update(load_file(file))
    save_file(edit(state), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text((directory / "config.json").read_text())
    return out


def test_keys_that_do_not_fit_are_named(checkpoints, tmp_path):
    """Missing, unexpected and mis-shaped keys raise errors naming them; strict=False loads the rest and reports
    what was missing (left as the model's init); ignore_mismatched_sizes skips the mis-shaped one."""
    source = checkpoints / "tiny-llama"
    gone = "model.layers.1.mlp.down_proj.weight"
    missing = _rewrite(source, tmp_path / "missing", lambda s: {k: v for k, v in s.items() if k != gone})
    with pytest.raises(PretrainedLoadError, match=gone.replace(".", r"\.")):
        load_pretrained(_on_meta(missing), missing)
    model = _on_meta(missing)
    report = load_pretrained(model, missing, strict=False)
    assert report.missing == [gone]
    assert not model.model.layers[1].mlp.down_proj.weight.is_meta

    extra = _rewrite(source, tmp_path / "extra", lambda s: {**s, "model.surplus.weight": torch.zeros(2)})
    with pytest.raises(PretrainedLoadError, match=r"model\.surplus\.weight"):
        load_pretrained(_on_meta(extra), extra)

    key = "model.layers.0.self_attn.o_proj.weight"
    wrong = _rewrite(source, tmp_path / "wrong", lambda s: {**s, key: torch.zeros(3, 3)})
    with pytest.raises(PretrainedLoadError, match=r"o_proj\.weight: checkpoint \(3, 3\) vs model \(64, 64\)"):
        load_pretrained(_on_meta(wrong), wrong)
    report = load_pretrained(_on_meta(wrong), wrong, ignore_mismatched_sizes=True, strict=False)
    assert len(report.mismatched) == 1


def test_transformers_renames_apply(checkpoints, tmp_path):
    """Keys are renamed as from_pretrained renames them: a base model's checkpoint (no ``model.`` prefix) loads
    into the causal-LM head model, and legacy LayerNorm ``gamma`` names into ``weight``."""
    source = checkpoints / "tiny-llama"
    bare = _rewrite(source, tmp_path / "bare", lambda s: {k.removeprefix("model."): v for k, v in s.items()})
    model = _on_meta(bare)
    report = load_pretrained(model, bare)
    reference = AutoModelForCausalLM.from_pretrained(source)
    _assert_same(model, reference)
    assert report.loaded == len(dict(reference.named_parameters()))

    torch.manual_seed(0)
    bert = build_model("tiny-bert", device="cpu").eval()
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma"): v for k, v in bert.state_dict().items()}
    assert any("gamma" in k for k in state)
    (tmp_path / "legacy").mkdir()
    save_file({k: v.clone() for k, v in state.items()}, tmp_path / "legacy" / "model.safetensors")
    with torch.device("meta"):
        model = type(bert)(bert.config).eval()
    load_pretrained(model, tmp_path / "legacy")
    _assert_same(model, bert)


def _split_over_one_rank(model: torch.nn.Module) -> None:
    """Every 2-d parameter a DTensor split on a one-rank mesh (the job's gloo group of one process): embeddings
    and the tied head by rows, GPT-2's Conv1D weights by columns (Megatron's column split) — the layouts the
    export streams, here without peers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.ndim != 2:
                continue
            if id(param) not in done:
                dim = 0 if isinstance(module, torch.nn.Embedding) else 1
                value = distribute_tensor(param.detach(), mesh, [Shard(dim)])
                done[id(param)] = torch.nn.Parameter(value, requires_grad=param.requires_grad)
            module._parameters[name] = done[id(param)]


def test_streaming_export_round_trip(checkpoints, tmp_path, monkeypatch):
    """save_pretrained of a loaded model whose weights are split by rows and by columns (on a one-rank mesh, so
    the export takes its streaming path): several files of at most max_shard_size, an index, no tied
    duplicate; from_pretrained reads it back bit for bit. The writer's memory, measured by torch's CPU
    allocator around the write (not the exporter's own report): never more than two 4 KiB blocks at once,
    while the largest tensor is 32 blocks (written whole, it would be that tensor's size)."""
    import torch.distributed as dist
    from common import allocation_peak

    import hf_colossal_auto.apply.pretrained.stream as stream

    source = checkpoints / "tiny-gpt2"
    model = _on_meta(source)
    load_pretrained(model, source)
    block = 4096
    monkeypatch.setattr(stream, "STREAM_BLOCK_BYTES", block)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        _split_over_one_rank(model)
        report, peak = allocation_peak(
            lambda: save_pretrained(model, tmp_path / "export", max_shard_size="200KB")
        )
    finally:
        dist.destroy_process_group()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    assert largest >= 32 * block
    # two blocks: the one being assembled from the columns and the previous one, which the writer's loop still
    # holds while the next is made
    assert peak <= 2 * block < largest / 8, (peak, largest)
    assert len(report.files) >= 3
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]
    _assert_same(
        AutoModelForCausalLM.from_pretrained(tmp_path / "export"),
        AutoModelForCausalLM.from_pretrained(source),
    )


def test_converted_checkpoints_round_trip(tmp_path):
    """Tensors transformers converts on load: a Mixtral checkpoint stores one tensor per expert, the model one
    fused parameter per layer. Loaded from meta: from_pretrained's values; exported: the per-expert keys again
    (the file written whole, after transformers' reverse conversion), which from_pretrained reads back."""
    torch.manual_seed(0)
    source = build_model("tiny-mixtral", device="cpu")
    source.save_pretrained(tmp_path / "ckpt", max_shard_size="100KB")
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(".experts.0." in k for k in index)
    model = _on_meta(tmp_path / "ckpt")
    report = load_pretrained(model, tmp_path / "ckpt")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    _assert_same(model, reference)
    assert report.bytes_read == report.checkpoint_bytes
    save_pretrained(model, tmp_path / "export", max_shard_size="100KB")
    exported = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(exported) == sorted(index)
    _assert_same(AutoModelForCausalLM.from_pretrained(tmp_path / "export"), reference)


def test_planned_save_pretrained_arguments(checkpoints, tmp_path):
    """The save_pretrained a plan installs (here on a one-process model): transformers' keyword arguments —
    ``state_dict`` written instead of the model's tensors (ties dropped from the model's own, though the dict's
    copies are separate), ``is_main_process=False`` writes nothing, ``save_function``/``safe_serialization``
    accepted as transformers 5 accepts them — and what it does not do refused, saying what to do instead."""
    from hf_colossal_auto.apply.pretrained import install_save_pretrained

    model = AutoModelForCausalLM.from_pretrained(checkpoints / "tiny-gpt2")
    install_save_pretrained(model, 10.0)
    model.save_pretrained(tmp_path / "not-main", is_main_process=False)
    assert not (tmp_path / "not-main").exists()
    state = {k: v + 1 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.save_pretrained(
        tmp_path / "state", state_dict=state, save_function=torch.save, safe_serialization=False
    )
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "state").state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in loaded)
    refused = {
        "push_to_hub": (True, "upload_folder"),
        "variant": ("fp16", "load the directory"),
        "distributed_checkpoint": (True, "save_state"),
    }
    for key, (value, advice) in refused.items():
        with pytest.raises(ValueError, match=advice):
            model.save_pretrained(tmp_path / key, **{key: value})


@pytest.mark.slow
def test_sharded_load_export_and_elastic_resume(checkpoints, tmp_path):
    """Two gloo ranks, one launch. Under a 1 x 2 tensor-parallel and a 2 x 1 FSDP plan, Llama and tied GPT-2 built
    on meta and loaded with ``pretrained=``: every parameter equals from_pretrained's; each rank's parameter
    storages take exactly its shards' bytes (no full copy behind a view), less than the full model, and it read
    only those bytes from the files. The exports load with from_pretrained, bit for bit, and each rank (the
    writer too) held at most one gathered tensor at a time; split tensors reach the writer in blocks, so
    under FSDP it never holds the largest tensor whole. DCP state saved under 1 x 2 TP resumes
    under 2 x 1 FSDP and in one process without a plan with the uninterrupted run's next two losses (a fresh
    AdamW misses the second). The accelerator with ``AutoParallelPlugin(pretrained=...)`` loads the same way and
    its ``save_model`` streams an export that loads. Every save line users call (transformers' examples, the
    model's save_pretrained with and without state_dict, save_model, get_state_dict, accelerator.save) under a
    DDP, an FSDP and a tensor-parallel plan: :func:`_check_save_paths`."""
    out = tmp_path / "out"
    out.mkdir()
    run_torchrun(
        str(ROOT / "tests" / "multiproc" / "check_pretrained.py"),
        "--ckpt",
        str(checkpoints),
        "--out",
        str(out),
    )
    result = json.loads((out / "result.json").read_text())
    for preset in PRESETS:
        reference = AutoModelForCausalLM.from_pretrained(checkpoints / preset)
        for layout in ("tp", "fsdp"):
            for rank in range(2):
                case = result[f"{preset} {layout} rank{rank}"]
                where = f"{preset} {layout} rank {rank}"
                assert case["differs"] == [], where
                assert case["tied"] == case["reference_tied"], where
                assert case["storage_bytes"] == case["shard_bytes"] < 0.75 * case["full_bytes"], where
                assert case["bytes_read"] == case["shard_bytes"], where  # fp32 into fp32: read = kept
                # written tensor by tensor: no rank held more than one full tensor at a time; split tensors
                # reached the writer in 4 KiB blocks, so under FSDP it never held the largest tensor whole;
                # the other rank only sends
                held = case["export"]["peak_held"]
                assert held <= case["largest_tensor"], where
                # measured by torch's CPU allocator around the write: the writer at most 2.5 blocks at once (a
                # row block assembled from both ranks' 2 KiB columns, the previous one, a received part) under
                # TP and FSDP, where the largest tensor is 32 blocks; the other rank sends views of its shards
                allocated = case["export"]["allocated_peak"]
                assert allocated <= (10 * 1024 if rank == 0 else 64) < case["largest_tensor"] / 8, (
                    where,
                    allocated,
                )
                if layout == "fsdp":
                    assert held < case["largest_tensor"] if rank == 0 else held == 0, (
                        where,
                        held,
                        case["largest_tensor"],
                    )
            assert result[f"{preset} {layout} rank0"]["export"]["files"] >= 3
            exported = AutoModelForCausalLM.from_pretrained(out / f"export-{preset}-{layout}")
            _assert_same(exported, reference)

    for key in ("tiny-llama fsdp", "tiny-gpt2 tp"):  # through transformers' shard-on-read
        for rank in range(2):
            case = result[f"{key} shard-on-read rank{rank}"]
            assert case["differs"] == [] and case["storage_bytes"] == case["shard_bytes"] == case["read"], key
    for rank in range(2):  # AutoParallelPlugin(pretrained=...) and the accelerator's streaming save_model
        case = result[f"accelerate rank{rank}"]
        assert case["differs"] == [] and case["sharded"] == result[f"tiny-llama tp rank{rank}"]["shard_bytes"]
    _assert_same(
        AutoModelForCausalLM.from_pretrained(out / "export-accelerate"),
        AutoModelForCausalLM.from_pretrained(checkpoints / "tiny-llama"),
    )

    _check_save_paths(out, result)

    elastic = result["elastic"]
    for key in ("loss", "next_loss"):
        assert elastic["fsdp"][key] == pytest.approx(elastic["tp"][key], abs=2e-6), key
    _resume_in_one_process(checkpoints / "tiny-llama", out / "elastic", elastic["tp"])


SAVED_BY_EVERY_PLAN = (
    "example",
    "all-ranks",
    "state-dict",
    "dtensor-state-dict",
    "save-model",
    "after-main-only",
)


def _check_save_paths(out: Path, result: dict) -> None:
    """What ``save_paths_case`` wrote under a DDP, an FSDP and a tensor-parallel plan: every directory loads
    with from_pretrained in this process with exactly the trained weights (``reference.pt``, torch.save of
    ``accelerator.get_state_dict``) and the eval loss the planned model had; config and generation config load;
    ``accelerator.save`` of the model's state dict on every rank loads with the same tensors; save_pretrained
    and accelerator.save on the main process alone write under DDP and raise an error saying to call them on
    every rank under a sharded plan."""
    from check_pretrained import SAVE_LAYOUTS, batches
    from transformers import GenerationConfig

    for layout in SAVE_LAYOUTS:
        root = out / f"save-{layout}"
        case = result[f"save {layout} rank0"]
        reference = torch.load(root / "reference.pt", weights_only=True)
        sharded = layout != "ddp"
        directories = SAVED_BY_EVERY_PLAN if sharded else (*SAVED_BY_EVERY_PLAN, "main-only")
        for name in directories:
            model = AutoModelForCausalLM.from_pretrained(root / name).eval()
            state = model.state_dict()
            assert state.keys() == reference.keys(), (layout, name)
            differs = [k for k in state if not torch.equal(state[k], reference[k])]
            assert differs == [], (layout, name, differs)
        for name in ("all-ranks", "save-model"):  # max_shard_size="200KB": several files and their index
            assert (root / name / "model.safetensors.index.json").is_file(), (layout, name)
        model = AutoModelForCausalLM.from_pretrained(root / "example").eval()
        with torch.no_grad():
            loss = float(model(**batches(model.config)[1]).loss)
        assert loss == pytest.approx(case["eval_loss"], abs=1e-5), layout
        assert AutoConfig.from_pretrained(root / "example").architectures == ["GPT2LMHeadModel"]
        GenerationConfig.from_pretrained(root / "example")
        saved = torch.load(root / "accelerator-save.bin", weights_only=True)  # accelerator.save, every rank
        assert saved.keys() == reference.keys()
        assert all(torch.equal(saved[k], reference[k]) for k in saved), layout
        for name in ("main-only", "main-only-accelerator-save"):
            if sharded:
                assert "did not call it within 0.5 s" in case[name] and "on every rank" in case[name], layout
            else:
                assert case[name] == "saved", (layout, name)
        assert (root / "alone.bin").exists() != sharded and (root / "main-only").exists() != sharded, layout


def _resume_in_one_process(pretrained: Path, state: Path, expected: dict) -> None:
    """The 2-rank TP state loaded into a plain model and AdamW in this process: the same next two losses; a
    fresh AdamW (no moments, step 0) gives another second loss, so the optimizer state was loaded."""
    from check_pretrained import LR, batches

    from hf_colossal_auto.apply.checkpoint import load_checkpoint

    losses = {}
    for fresh in (False, True):
        model = AutoModelForCausalLM.from_pretrained(pretrained).eval()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        load_checkpoint(model, None if fresh else opt, state)
        data = batches(model.config)
        loss = model(**data[2]).loss
        loss.backward()
        opt.step()
        with torch.no_grad():
            losses[fresh] = (float(loss), float(model(**data[3]).loss))
    assert losses[False][0] == pytest.approx(expected["loss"], abs=2e-6)
    assert losses[False][1] == pytest.approx(expected["next_loss"], abs=2e-6)
    assert abs(losses[True][1] - expected["next_loss"]) > 1e-4

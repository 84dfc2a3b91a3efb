"""The pretraining recipes: their objectives (BERT masking, T5 span corruption), packing, and short runs —
in this process for each recipe, and through ``accelerate launch`` on 2 CPU processes under a plan."""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrun_launch import accelerate_launch_command, why_it_failed

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
sys.path.insert(0, str(RECIPES))

from _shared.data import BlockDataset, pack  # noqa: E402
from _shared.metrics import read_metrics  # noqa: E402
from _shared.objectives import (  # noqa: E402
    mask_tokens,
    noise_span_count,
    random_spans_noise_mask,
    span_corrupt,
    t5_lengths,
)
from _shared.tokenizer import padded_vocab_size, sentinel_ids, train_tokenizer  # noqa: E402


def quick(steps: int = 8, batch: int = 4) -> list[str]:
    """Few, short steps on a small corpus: enough for the loss of every tiny model to fall, fast on 2 cores."""
    return [
        "--model", "tiny", "--max_steps", str(steps), "--per_device_batch_size", str(batch), "--seq_len", "64",
        "--synthetic_documents", "300", "--warmup_steps", "1", "--lr", "3e-3", "--eval_steps", "4",
        "--max_eval_batches", "2",
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------- T5 span corruption
def test_t5_lengths_are_the_t5_papers():
    # The figures of the T5 code / HF's run_t5_mlm_flax.py for 512 input tokens at density 0.15, mean span 3.
    assert t5_lengths(512) == (568, 114)
    assert t5_lengths(512, noise_density=0.5, mean_span_length=3.0)[0] > 512


@pytest.mark.parametrize("inputs_length", [16, 64, 128, 512])
def test_span_corruption_lengths_sentinels_and_round_trip(inputs_length):
    raw_length, target_length = t5_lengths(inputs_length)
    n_spans = noise_span_count(raw_length)
    sentinels = list(range(1000, 1000 - n_spans, -1))  # <extra_id_0> highest, as in T5's vocabulary
    eos = 1
    for seed in range(5):
        ids = np.arange(10, 10 + raw_length)
        inputs, labels = span_corrupt(ids, np.random.default_rng(seed), sentinel_ids=sentinels, eos_id=eos)
        assert (len(inputs), len(labels)) == (inputs_length, target_length)
        assert inputs[-1] == eos and labels[-1] == eos
        # sentinels appear once each, in order <extra_id_0>, <extra_id_1>, ... in both, and labels lead with one
        assert [t for t in inputs if t >= 1000 - n_spans] == sentinels
        assert [t for t in labels if t >= 1000 - n_spans] == sentinels
        assert labels[0] == sentinels[0]
        # filling each sentinel of the input with its span from the labels gives the original block back
        spans, current = {}, None
        for t in labels[:-1]:
            current = t if t in sentinels else current
            if t not in sentinels:
                spans.setdefault(current, []).append(t)
        rebuilt = [x for t in inputs[:-1] for x in (spans[t] if t in sentinels else [t])]
        assert rebuilt == ids.tolist()
        assert len(ids) - (len(inputs) - 1 - n_spans) == round(0.15 * raw_length)


def test_noise_mask_starts_with_kept_tokens_and_has_mean_span_three():
    lengths = []
    for seed in range(20):
        mask = random_spans_noise_mask(568, np.random.default_rng(seed))
        assert not mask[0] and mask[-1]
        assert mask.sum() == round(568 * 0.15)
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        assert len(starts) == round(round(568 * 0.15) / 3)
        lengths.append(mask.sum() / len(starts))
    assert abs(np.mean(lengths) - 3.0) < 0.1


def test_too_few_sentinels_is_an_error_that_says_what_to_do():
    with pytest.raises(ValueError, match="sentinel"):
        span_corrupt(np.arange(200), np.random.default_rng(0), sentinel_ids=[900, 899], eos_id=1)


# ----------------------------------------------------------------------------------------- BERT masking
def test_bert_masking_is_15_percent_with_80_10_10():
    rng = np.random.default_rng(0)
    special = [0, 1, 2, 3, 4]
    ids = rng.integers(5, 1000, size=200_000)
    ids[::50] = 3  # separators inside the packed block are never chosen
    inputs, labels = mask_tokens(ids, rng, mask_id=4, vocab_size=1000, special_ids=special)
    chosen = labels != -100
    ordinary = ~np.isin(ids, special)
    assert not chosen[~ordinary].any()
    assert abs(chosen.sum() / ordinary.sum() - 0.15) < 0.005
    assert (labels[chosen] == ids[chosen]).all()
    assert (inputs[~chosen] == ids[~chosen]).all()
    masked = (inputs[chosen] == 4).mean()
    kept = (inputs[chosen] == ids[chosen]).mean()
    assert abs(masked - 0.8) < 0.01 and abs(kept - 0.1) < 0.01
    assert abs(1 - masked - kept - 0.1) < 0.01  # the rest became random tokens


def test_bert_masking_always_predicts_something():
    for seed in range(50):
        _, labels = mask_tokens(
            np.array([2, 7, 8, 3]),
            np.random.default_rng(seed),
            mask_id=4,
            vocab_size=10,
            special_ids=[2, 3, 4],
        )
        assert (labels != -100).sum() >= 1 and labels[0] == labels[-1] == -100


# ----------------------------------------------------------------------------------------- data and tokenizers
def test_pack_concatenates_with_separators_and_drops_the_tail():
    blocks = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4, separator_id=0)
    assert blocks.tolist() == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]]
    with pytest.raises(ValueError, match="fewer than one block"):
        pack([[1, 2]], 8, separator_id=0)


def test_examples_depend_on_seed_epoch_and_index_only():
    def make(block, rng):
        return {"input_ids": block + rng.integers(0, 1000, size=block.shape)}

    blocks = np.zeros((4, 8), dtype=np.int64)
    a, b = BlockDataset(blocks, make, seed=1), BlockDataset(blocks, make, seed=1)
    assert torch.equal(a[2]["input_ids"], b[2]["input_ids"])  # two processes draw the same example
    assert not torch.equal(a[2]["input_ids"], a[3]["input_ids"])
    b.set_epoch(1)
    assert not torch.equal(a[2]["input_ids"], b[2]["input_ids"])  # fresh masks next epoch


def test_t5_tokenizer_has_ordered_sentinels_and_padded_vocab():
    from _shared.corpus import synthetic_corpus

    tokenizer = train_tokenizer("unigram", synthetic_corpus(200), vocab_size=600, num_sentinels=100)
    ids = sentinel_ids(tokenizer, 100)
    assert ids[0] == len(tokenizer) - 1 and ids == sorted(ids, reverse=True)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    # a word the corpus only ever writes between spaces is one piece, not spelled out in characters
    assert len(tokenizer("After three", add_special_tokens=False)["input_ids"]) == 2
    assert padded_vocab_size(tokenizer) % 64 == 0 and padded_vocab_size(tokenizer) >= len(tokenizer)
    with pytest.raises(ValueError, match="extra_id_100"):
        sentinel_ids(tokenizer, 101)


def test_cached_tokenizer_is_reused_only_for_the_same_settings(tmp_path):
    from _shared.corpus import synthetic_corpus
    from _shared.tokenizer import load_or_train_tokenizer

    docs = synthetic_corpus(50)
    first = load_or_train_tokenizer("bpe", docs, tmp_path, 400, source="synthetic:50")
    again = load_or_train_tokenizer("bpe", [], tmp_path, 400, source="synthetic:50")  # no text needed: cached
    assert again.get_vocab() == first.get_vocab()
    with pytest.raises(SystemExit, match="another --output_dir"):
        load_or_train_tokenizer("bpe", docs, tmp_path, 400, source="corpus.txt")


# ----------------------------------------------------------------------------------------- runs
@pytest.fixture
def fresh_accelerate_state():
    """Each in-process run starts from no accelerate singletons, as a fresh script would."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _run_in_process(script: str, argv: list[str]) -> None:
    module = importlib.import_module(script)
    recipe = next(v for v in vars(module).values() if type(v).__name__ == "Recipe")
    module.run(recipe, argv)


def _check_metrics(path: Path, steps: int) -> list[dict]:
    records = read_metrics(path)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for r in records:
        assert {"step", "loss", "lr", "tokens"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["lr"] >= 0
    assert all(b["tokens"] > a["tokens"] for a, b in zip(records, records[1:], strict=False))
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.1, losses
    assert "eval_loss" in records[-1] and math.isfinite(records[-1]["eval_loss"])
    return records


def _check_export(final: Path, task_class: str) -> None:
    import transformers

    model = getattr(transformers, task_class).from_pretrained(final)
    tokenizer = transformers.AutoTokenizer.from_pretrained(final)
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tokenizer)
    batch = tokenizer(["the river was quiet."], return_tensors="pt")
    assert batch["input_ids"].max() < model.config.vocab_size


@pytest.mark.parametrize(
    "script, task_class",
    [
        ("pretrain_gpt", "AutoModelForCausalLM"),
        ("pretrain_bert", "AutoModelForMaskedLM"),
        ("pretrain_t5", "AutoModelForSeq2SeqLM"),
    ],
)
def test_recipe_trains_and_exports(script, task_class, tmp_path, fresh_accelerate_state):
    out = tmp_path / script
    _run_in_process(script, [*quick(), "--output_dir", str(out)])
    _check_metrics(out / "metrics.jsonl", 8)
    _check_export(out / "final", task_class)
    assert (out / "tokenizer" / "tokenizer.json").is_file()  # cached for the next run


def test_gpt_resume_continues_with_the_same_losses(tmp_path, fresh_accelerate_state):
    from _shared.checkpoints import latest_checkpoint
    from accelerate.state import AcceleratorState, GradientState

    first, second = tmp_path / "first", tmp_path / "second"
    _run_in_process("pretrain_gpt", [*quick(6), "--output_dir", str(first), "--save_steps", "3"])
    straight = read_metrics(first / "metrics.jsonl")
    assert latest_checkpoint(first) == first / "checkpoints" / "step_6"
    _half_written_checkpoints_are_skipped_or_refused(first, tmp_path / "damaged")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    checkpoint = first / "checkpoints" / "step_3"
    _run_in_process(
        "pretrain_gpt", [*quick(6), "--output_dir", str(second), "--resume_from_checkpoint", str(checkpoint)]
    )
    resumed = read_metrics(second / "metrics.jsonl")
    # steps 4..6 ran again from step 3's checkpoint (model, optimizer, scheduler, RNG, data position)
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for a, b in zip(straight[3:], resumed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["lr"] == pytest.approx(b["lr"]) and a["tokens"] == b["tokens"]


def _half_written_checkpoints_are_skipped_or_refused(run: Path, root: Path) -> None:
    """Copies of a real run's checkpoints with step 6's made half-written, as a kill while saving leaves it:
    its loop state missing, or its largest file (a model/optimizer shard) truncated. ``latest`` falls back
    to step 3; naming step 6 is refused with the reason."""
    import shutil

    from _shared.checkpoints import latest_checkpoint, resolve

    def damaged(name: str, damage) -> Path:
        out = root / name
        shutil.copytree(run / "checkpoints", out / "checkpoints")
        damage(out / "checkpoints" / "step_6")
        return out

    def truncate(step: Path) -> None:
        largest = max((f for f in step.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
        with open(largest, "r+b") as f:
            f.truncate(largest.stat().st_size // 2)

    no_state = damaged("no_state", lambda step: (step / "recipe_state.json").unlink())
    truncated = damaged("truncated", truncate)
    for out, reason in ((no_state, "no recipe_state.json"), (truncated, "truncated")):
        assert latest_checkpoint(out) == out / "checkpoints" / "step_3"
        assert resolve(out, "latest") == out / "checkpoints" / "step_3"
        with pytest.raises(SystemExit, match=f"step_6.*not a complete checkpoint.*{reason}"):
            resolve(out, str(out / "checkpoints" / "step_6"))


def test_a_scheduler_state_that_would_run_code_is_refused(tmp_path):
    """Loading never runs code from a checkpoint directory: a crafted ``lr_scheduler.pt`` (a pickle whose
    load would call ``os.system``) is refused with a message naming it, and the command never runs."""
    from _shared.checkpoints import read_scheduler_state

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    torch.save({"last_epoch": 3, "payload": Payload()}, tmp_path / "lr_scheduler.pt")
    with pytest.raises(SystemExit, match=r"refusing to resume from .*lr_scheduler\.pt.*posix\.system"):
        read_scheduler_state(tmp_path)
    assert not (tmp_path / "ran").exists()
    torch.save({"last_epoch": 3, "_last_lr": [0.1]}, tmp_path / "lr_scheduler.pt")  # what a scheduler saves
    assert read_scheduler_state(tmp_path) == {"last_epoch": 3, "_last_lr": [0.1]}


def test_unknown_model_preset_is_refused(tmp_path, fresh_accelerate_state):
    with pytest.raises(SystemExit, match="unknown preset for the gpt recipe"):
        _run_in_process("pretrain_gpt", ["--model", "bert-base", "--output_dir", str(tmp_path)])


def _no_dropout_config(preset: str, path: Path, **sizes: int) -> Path:
    """``preset`` without dropout (and resized by ``sizes``), as a config.json for the recipes' ``--model``.
    Why no dropout: the ranks of a tensor-parallel group draw masks for their shards of an activation, not the
    masks one process draws for the whole of it, so with dropout no run under a plan repeats one process's."""
    from hf_colossal_auto.models import load_config

    config = load_config(preset)
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "dropout_rate"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    for name, value in sizes.items():
        setattr(config, name, value)
    config.to_json_file(path)
    return path


# BERT and T5 against one process: script -> (task class, preset, resized config); compared over 4 steps
COMPARED = {
    "pretrain_bert": ("AutoModelForMaskedLM", "tiny-bert", {}),
    "pretrain_t5": ("AutoModelForSeq2SeqLM", "tiny-t5", {"d_model": 128, "d_ff": 256, "d_kv": 32}),
}
COMPARED_STEPS = 4


@pytest.fixture(scope="module")
def two_process_recipes(tmp_path_factory) -> Path:
    """All three recipes under a 1x2 tensor-parallel plan in ONE ``accelerate launch`` of 2 CPU processes
    (tests/multiproc/run_recipes.py runs them one after the other as their scripts would): the process start
    and imports cost more than a tiny recipe's run, so the recipes share them. The literal README command
    (``accelerate launch recipes/pretrain_gpt.py``) is run by tests/test_reliability.py's killed-rank test.

    GPT runs as the README shows it (tiny preset, 8 steps) into ``two/pretrain_gpt``. BERT and T5 run first in
    this process (``one/``: per-device batch 8) and then on the 2 ranks (``two/``: 4 per device, the 2 ranks of
    one tensor-parallel group sharing their 8 rows): same seed, data, global batch and tokenizer (the WordPiece
    and Unigram trainers order tied pieces differently in each process, so the 2-process runs take the
    1-process run's). Each recipe's plan is saved as ``<script>.plan.json``."""
    from accelerate.state import AcceleratorState, GradientState

    root = tmp_path_factory.mktemp("recipes")
    one, two = root / "one", root / "two"

    def compared(script: str, batch: int, out: Path) -> list[str]:
        _, preset, sizes = COMPARED[script]
        config = _no_dropout_config(preset, root / f"{script}.json", **sizes)
        # after quick()'s flags, so these win: a config path is not "tiny", whose vocabulary default is 1024
        model = ["--model", str(config), "--vocab_size", "1024"]
        # one full eval batch per process: where the eval set runs short, accelerate pads the last batch of 2
        # processes with repeated rows (one process has no such batch), and the group's eval loss is then plain
        # accelerate's on 2 processes, not one process's (the batch rule, docs/ARCHITECTURE.md)
        evaluation = ["--max_eval_batches", "1"]
        return [*quick(COMPARED_STEPS, batch=batch), *model, *evaluation, "--output_dir", str(out / script)]

    for script in COMPARED:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        _run_in_process(script, compared(script, 8, one))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    argv = {
        "pretrain_gpt": [*quick(), "--output_dir", str(two / "pretrain_gpt")],
        **{s: [*compared(s, 4, two), "--tokenizer", str(one / s / "tokenizer")] for s in COMPARED},
    }
    runs = [
        [
            script,
            [*args, "--mesh_shape", "1x2"],
            {"HF_COLOSSAL_AUTO_SAVE_PLAN_PATH": str(root / f"{script}.plan.json")},
        ]
        for script, args in argv.items()
    ]
    # GPT under pipeline stages (fixed to pp 2: on 2 tiny ranks the search keeps to plans without them)
    runs.append(
        [
            "pretrain_gpt",
            [*quick(), "--output_dir", str(two / "pretrain_gpt_pp"), "--pipeline", "2"],
            {"HF_COLOSSAL_AUTO_SAVE_PLAN_PATH": str(root / "pretrain_gpt_pp.plan.json")},
        ]
    )
    # fine-tuning a local checkpoint, data parallel (2x1), with the token embedding frozen
    checkpoint = tiny_pretrained_checkpoint(root / "pretrained")
    runs.append(
        ["finetune_causal_lm", [*finetune_args(checkpoint, two / "finetune"), "--mesh_shape", "2x1"], {}]
    )
    cmd = accelerate_launch_command(str(ROOT / "tests" / "multiproc" / "run_recipes.py"), json.dumps(runs))
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, why_it_failed(proc)
    (root / "stdout.txt").write_text(proc.stdout)
    return root


def _sharded_over_tp(plan_path: Path) -> bool:
    from hf_colossal_auto.plan import Plan

    plan = Plan.load(plan_path)
    tp = plan.mesh_axis_names.index("tp")
    assert plan.mesh_shape == (1, 2)
    return any(p[tp].startswith("S") for p in plan.param_placements.values())


@pytest.mark.slow
def test_gpt_recipe_on_two_processes_under_a_plan(two_process_recipes):
    """The README's 2-CPU-process GPT run, tensor parallel (mesh forced to 1x2 so that TP is what runs)."""
    out = two_process_recipes / "two" / "pretrain_gpt"
    stdout = (two_process_recipes / "stdout.txt").read_text()
    summary = next(line for line in stdout.splitlines() if line.startswith("gpt: "))
    assert "2 process(es), data-parallel size 1" in summary  # both ranks of one tensor-parallel group
    assert _sharded_over_tp(two_process_recipes / "pretrain_gpt.plan.json")
    records = _check_metrics(out / "metrics.jsonl", 8)
    assert (
        records[0]["tokens"] == 4 * 2 * 64
    )  # global batch: per-device batch x processes, TP ranks sharing it
    _check_export(out / "final", "AutoModelForCausalLM")
    assert json.loads((out / "final" / "config.json").read_text())["model_type"] == "gpt2"


@pytest.mark.slow
def test_gpt_recipe_on_two_processes_under_pipeline_stages(two_process_recipes):
    """The GPT recipe with ``--pipeline 2``: the accelerator plans pp 2 (a schedule over each step's batch),
    the loop trains (loss falls, eval on every rank), the two ranks read one batch (tokens as one group's),
    and the export — ``accelerator.get_state_dict`` gathered from both stages, written by the main process —
    loads in one process with the trained weights (not the initial ones: the logged loss fell)."""
    from hf_colossal_auto.plan import Plan

    plan = Plan.load(two_process_recipes / "pretrain_gpt_pp.plan.json")
    assert plan.pp_size == 2 and plan.micro_batches >= 2, plan.mesh_shape
    out = two_process_recipes / "two" / "pretrain_gpt_pp"
    records = _check_metrics(out / "metrics.jsonl", 8)
    assert records[0]["tokens"] == 4 * 2 * 64  # the pipeline's ranks share one batch of both processes' rows
    _check_export(out / "final", "AutoModelForCausalLM")


@pytest.mark.slow
@pytest.mark.parametrize("script", list(COMPARED))
def test_bert_and_t5_recipes_on_two_processes_match_one_process(script, two_process_recipes):
    """BERT and T5 pretraining under a real tensor-parallel plan (``--mesh_shape 1x2``) train as they do in
    one process, on the same seed, data, tokenizer and global batch (see ``two_process_recipes``).

    So every logged loss, gradient norm (before clipping: it sees the sharded gradients) and the eval loss
    must agree to fp32 rounding: measured at most 1e-7 (losses) and 6e-7 (gradient norms) relative, over both
    recipes and all steps; the bounds are a few times that. A wrong reduction or a misplaced shard moves them
    by far more (a loss at 6 to 7 changes by ~1e-2 in one step). Four steps are enough for the loss to fall
    in both runs; the export loads with ``from_pretrained``.

    T5 is widened to d_model 128: at the tiny preset's 64 the planner keeps every T5 weight replicated (tensor
    parallelism does not pay there), so no plan would apply; the saved plans prove one did."""
    task_class = COMPARED[script][0]
    assert _sharded_over_tp(two_process_recipes / f"{script}.plan.json"), f"{script}: nothing sharded"
    reference = _check_metrics(two_process_recipes / "one" / script / "metrics.jsonl", COMPARED_STEPS)
    records = _check_metrics(two_process_recipes / "two" / script / "metrics.jsonl", COMPARED_STEPS)
    for a, b in zip(reference, records, strict=True):
        assert (a["tokens"], a["lr"]) == (b["tokens"], b["lr"]), a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=5e-7, abs=0), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=2e-6, abs=0), a["step"]
    assert records[-1]["eval_loss"] == pytest.approx(reference[-1]["eval_loss"], rel=5e-7, abs=0)
    _check_export(two_process_recipes / "two" / script / "final", task_class)


# ----------------------------------------------------------------------------------------- fine-tuning
SFT_SAMPLE = RECIPES / "data" / "sft_sample.jsonl"


def tiny_pretrained_checkpoint(path: Path) -> Path:
    """A tiny Llama "pretrained" checkpoint made here (random weights, safetensors) with a BPE tokenizer trained
    on the sample data's text and no chat template: what ``--model_name_or_path`` reads, nothing downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    texts = ["### User:", "### Assistant:", "### System:"]
    for line in SFT_SAMPLE.read_text().splitlines():
        record = json.loads(line)
        messages = record.get("messages") or [{"content": record["prompt"]}, {"content": record["response"]}]
        texts += [m["content"] for m in messages]
    tokenizer = train_tokenizer("bpe", texts * 4, 512)
    tokenizer.eos_token = "<|endoftext|>"
    config = LlamaConfig(
        vocab_size=padded_vocab_size(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def finetune_args(checkpoint: Path, out: Path) -> list[str]:
    """8 steps on the sample data, embeddings frozen: enough for the loss to fall on 2 cores."""
    return [
        "--model_name_or_path", str(checkpoint), "--train_file", str(SFT_SAMPLE), "--output_dir", str(out),
        "--max_steps", "8", "--lr", "3e-3", "--max_seq_len", "64", "--per_device_batch_size", "4",
        "--freeze", "embed_tokens",
    ]  # fmt: skip


def test_sft_labels_are_the_assistant_turns_only(tmp_path):
    """Every label that is not -100 is a token the assistant wrote (its text, the EOS ending its turn); the
    system and user turns, the headers and the next turn's header are masked. Both line formats."""
    from finetune_causal_lm import (
        IGNORE_INDEX,
        ensure_chat_template,
        read_conversations,
        tokenize_conversation,
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pretrained_checkpoint(tmp_path / "ckpt"))
    ensure_chat_template(tokenizer)
    conversations = read_conversations(SFT_SAMPLE)
    assert len(conversations) >= 30
    for messages in conversations:
        example = tokenize_conversation(tokenizer, messages, 512)
        ids, labels = example["input_ids"], example["labels"]
        learned = tokenizer.decode([t for t in labels if t != IGNORE_INDEX])
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert learned == "".join(f"{r}{tokenizer.eos_token}\n" for r in replies)
        assert all(lab in (IGNORE_INDEX, t) for t, lab in zip(ids, labels, strict=True))
        assert labels[0] == IGNORE_INDEX  # the conversation opens with a user or system header
    cut = tokenize_conversation(tokenizer, conversations[0], 5)
    assert len(cut["input_ids"]) == len(cut["labels"]) == 5


def test_sft_rows_under_context_parallelism(monkeypatch):
    """``--context_parallel`` (else HF_COLOSSAL_AUTO_CONTEXT_PARALLEL) is parsed naming its source; under a fixed
    cp degree padded rows are padded to a multiple of 2 x cp tokens and packed blocks that are not one are
    refused, saying what to use; 'auto' and 1 keep --max_seq_len."""
    from finetune_causal_lm import SFTDataset, build_parser, context_parallel_degree, row_length

    monkeypatch.delenv("HF_COLOSSAL_AUTO_CONTEXT_PARALLEL", raising=False)
    args = build_parser().parse_args(
        ["--model_name_or_path", "m", "--train_file", "f", "--context_parallel", "2"]
    )
    assert context_parallel_degree(args.context_parallel) == 2
    assert context_parallel_degree(None) is None
    monkeypatch.setenv("HF_COLOSSAL_AUTO_CONTEXT_PARALLEL", "auto")
    assert context_parallel_degree(None) == "auto"
    with pytest.raises(SystemExit, match="--context_parallel from the command line"):
        context_parallel_degree("two")
    assert row_length(66, 2, packing=False) == 68 and row_length(64, 2, packing=False) == 64
    assert row_length(66, "auto", packing=False) == row_length(66, 1, packing=True) == 66
    with pytest.raises(SystemExit, match="2 x cp = 4 equal chunks.*e.g. 64"):
        row_length(66, 2, packing=True)
    rows = SFTDataset([{"input_ids": [5] * 10, "labels": [5] * 10}], row_length(66, 2, False), 0, False)
    assert rows[0]["input_ids"].shape == rows[0]["attention_mask"].shape == (68,)


def test_sft_data_errors_name_the_line(tmp_path):
    from finetune_causal_lm import read_conversations

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"question": "a"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected"):
        read_conversations(bad)
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="no assistant message"):
        read_conversations(bad)


def _check_finetune(out: Path, checkpoint: Path) -> dict:
    """Loss falls; the export loads with from_pretrained in this process (weights and the chat template used
    for training), and the frozen embedding is the checkpoint's bit for bit while every trained tensor moved."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    summary = json.loads((out / "summary.json").read_text())
    losses = summary["losses"]
    assert len(losses) == 8 and np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.5, losses
    assert summary["frozen"] == ["model.embed_tokens.weight"]
    before = load_file(checkpoint / "model.safetensors")
    after = load_file(out / "final" / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name in before:
        assert torch.equal(before[name], after[name]) == (name == "model.embed_tokens.weight"), name
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What color is snow?"}], add_generation_prompt=True, return_tensors="pt"
    )
    prompt = prompt["input_ids"] if not isinstance(prompt, torch.Tensor) else prompt
    assert prompt.shape[-1] > 3 and tokenizer.decode(prompt[0]).endswith("### Assistant:\n")
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, after[name]), name
    return summary


def test_finetune_recipe_in_one_process(tmp_path, fresh_accelerate_state):
    """The README's one-process command: the checkpoint loaded into a meta model, trained, exported."""
    checkpoint = tiny_pretrained_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "sft"
    _run_main("finetune_causal_lm", finetune_args(checkpoint, out))
    assert _check_finetune(out, checkpoint)["plan"] is None  # one process: nothing to plan


@pytest.mark.slow
def test_finetune_recipe_on_two_processes_under_a_plan(two_process_recipes):
    """Fine-tuning on 2 gloo ranks, data parallel (2x1): each rank loaded only its shards of the checkpoint,
    the frozen embedding got no gradient or update (no data-parallel sync touched it), the export loads."""
    summary = _check_finetune(two_process_recipes / "two" / "finetune", two_process_recipes / "pretrained")
    assert summary["plan"] == [2, 1]
    # rank 0 read its shards only: half of every weight under FSDP, all of them under DDP (replicas)
    share = 0.5 if summary["dp_mode"] == "fsdp" else 1.0
    assert summary["bytes_read"] == pytest.approx(share * summary["checkpoint_bytes"], rel=0.02)


def _run_main(script: str, argv: list[str]) -> None:
    importlib.import_module(script).main(argv)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_sft_labels_follow_the_tokenizers_own_chat_template(tmp_path):
    """A tokenizer's own template is used as it is (ChatML here): the assistant's text and the template's own
    end of turn are learned, the ``<|im_start|>assistant`` header the prompt ends with is not."""
    from finetune_causal_lm import IGNORE_INDEX, ensure_chat_template, tokenize_conversation
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pretrained_checkpoint(tmp_path / "ckpt"))
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    ensure_chat_template(tokenizer)
    assert tokenizer.chat_template == CHATML
    messages = [
        {"role": "user", "content": "What color is snow?"},
        {"role": "assistant", "content": "The snow is white."},
        {"role": "user", "content": "And coal?"},
        {"role": "assistant", "content": "The coal is black."},
    ]
    example = tokenize_conversation(tokenizer, messages, 512)
    learned = [t for t in example["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(learned) == "The snow is white.<|im_end|>\nThe coal is black.<|im_end|>\n"


def test_sft_rows_padded_or_packed_keep_the_labels():
    """Unpacked: one conversation per row, padded with masked labels and attention; packed: every token once,
    in order, in full rows (the tail shorter than a row dropped); rows without a label are dropped."""
    from finetune_causal_lm import IGNORE_INDEX, SFTDataset

    examples = [
        {"input_ids": [1, 2, 3, 4], "labels": [IGNORE_INDEX, IGNORE_INDEX, 3, 4]},
        {"input_ids": [5, 6, 7], "labels": [IGNORE_INDEX, 6, 7]},
        {"input_ids": [8, 9], "labels": [IGNORE_INDEX, IGNORE_INDEX]},
    ]
    padded = SFTDataset(examples, 5, pad_id=0, packing=False)
    assert len(padded) == 2  # the third has nothing to learn
    assert padded[0]["input_ids"].tolist() == [1, 2, 3, 4, 0]
    assert padded[0]["attention_mask"].tolist() == [1, 1, 1, 1, 0]
    assert padded[0]["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 3, 4, IGNORE_INDEX]
    packed = SFTDataset(examples, 4, pad_id=0, packing=True)
    assert [r["input_ids"].tolist() for r in packed] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [r["labels"].tolist() for r in packed] == [
        [IGNORE_INDEX, IGNORE_INDEX, 3, 4],
        [IGNORE_INDEX, 6, 7, IGNORE_INDEX],
    ]
    assert all(r["attention_mask"].all() for r in packed)
    with pytest.raises(ValueError, match="raise --max_seq_len"):
        SFTDataset(examples[2:], 4, pad_id=0, packing=False)

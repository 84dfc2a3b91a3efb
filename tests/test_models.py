import json
import math
import os

import pytest
import torch

from hf_colossal_auto.models import (
    build_model,
    list_presets,
    load_config,
    make_example_inputs,
    max_positions,
    param_count,
    task_of,
)

TINY = ["tiny-gpt2", "tiny-bert", "tiny-t5", "tiny-llama"]
FULL_SIZE = [
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
    "bert-base",
    "bert-large",
    "t5-small",
    "t5-base",
    "t5-large",
    "llama-7b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "mistral-7b",
]
EXPECTED_TASK = {
    "gpt2": "causal-lm",
    "bert": "masked-lm",
    "t5": "seq2seq-lm",
    "llama": "causal-lm",
    "qwen2": "causal-lm",
    "mistral": "causal-lm",
}

# Published parameter counts. T5 base/large use the Hub figures (223M, 738M): the paper's rounded
# "220M"/"770M" are not what the released checkpoints hold. BERT counts the MLM head without the pooler.
PUBLIC_PARAMS = {
    "gpt2": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-large": 774e6,
    "gpt2-xl": 1.558e9,
    "bert-base": 110e6,
    "bert-large": 336e6,
    "t5-small": 60.5e6,
    "t5-base": 223e6,
    "t5-large": 738e6,
    "llama-7b": 6.74e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "qwen2.5-7b": 7.61e9,
    "qwen2.5-72b": 72.7e9,
    "mistral-7b": 7.25e9,
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_list_presets_covers_the_families():
    presets = list_presets()
    assert set(TINY + FULL_SIZE) <= set(presets)
    assert presets == sorted(presets)


@pytest.mark.parametrize("name", TINY + FULL_SIZE)
def test_preset_config_is_complete(name):
    config = load_config(name)
    assert config.architectures and len(config.architectures) == 1
    assert config.model_type in EXPECTED_TASK
    assert task_of(config) == EXPECTED_TASK[config.model_type]
    assert config.use_cache is False
    if config.model_type == "t5":
        assert config.decoder_start_token_id == 0
        assert config.pad_token_id == 0


@pytest.mark.parametrize("name", TINY + FULL_SIZE)
def test_preset_builds_on_meta_without_storage(name):
    model = build_model(name)
    assert model.training
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "sdpa"
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors
    assert all(t.device.type == "meta" for t in tensors)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert task_of(model) == EXPECTED_TASK[model.config.model_type]


@pytest.mark.parametrize("name", FULL_SIZE)
def test_param_counts_match_published(name):
    count = param_count(build_model(name))
    assert count == pytest.approx(PUBLIC_PARAMS[name], rel=0.01)


def test_tied_embeddings_follow_the_real_models():
    gpt2 = build_model("gpt2")
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight
    t5 = build_model("t5-small")
    assert t5.lm_head.weight is t5.shared.weight
    bert = build_model("bert-base")
    assert bert.cls.predictions.decoder.weight is bert.bert.embeddings.word_embeddings.weight
    llama = build_model("llama-7b")
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight


def test_meta_build_of_7b_allocates_nothing():
    build_model("tiny-llama")  # import the modeling code first
    before = _rss_bytes()
    model = build_model("llama-7b")
    grown = _rss_bytes() - before
    assert param_count(model) > 6e9
    assert grown < 512 * 2**20, f"meta build grew RSS by {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_gives_finite_loss(tiny_model, name):
    model = tiny_model(name)
    assert all(p.device.type == "cpu" for p in model.parameters())
    batch = make_example_inputs(model, batch_size=2, seq_len=16, seed=0)
    loss = model(**batch).loss
    assert loss.dim() == 0
    assert torch.isfinite(loss)
    # Random init over a 512-token vocab: the loss sits near ln(512).
    assert abs(loss.item() - math.log(model.config.vocab_size)) < 1.5
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(grads) >= 0.9 * len(list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


def test_cpu_build_is_seeded_by_the_caller(tiny_model):
    a = tiny_model("tiny-llama", seed=3).state_dict()
    b = tiny_model("tiny-llama", seed=3).state_dict()
    c = tiny_model("tiny-llama", seed=4).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_build_options():
    assert build_model("tiny-gpt2", attn_implementation="eager").config._attn_implementation == "eager"
    model = build_model("tiny-llama", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    config = load_config("tiny-gpt2")
    config.use_cache = True
    build_model(config)
    assert config.use_cache is True, "build_model must not modify the caller's config"


def test_task_picks_the_head_when_config_has_no_architectures():
    config = load_config("tiny-gpt2")
    config.architectures = None
    assert task_of(config) == "causal-lm"
    assert type(build_model(config)).__name__ == "GPT2LMHeadModel"
    bert = load_config("tiny-bert")
    bert.architectures = None
    assert task_of(bert) == "masked-lm"
    assert type(build_model(bert, task="masked-lm")).__name__ == "BertForMaskedLM"
    t5 = load_config("tiny-t5")
    t5.architectures = None
    assert task_of(t5) == "seq2seq-lm"
    with pytest.raises(ValueError, match="unknown task"):
        build_model("tiny-gpt2", task="image-classification")


def test_load_config_from_path(tmp_path):
    data = json.loads(json.dumps(load_config("tiny-llama").to_dict()))
    data["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(data))
    for path in (tmp_path / "config.json", tmp_path, str(tmp_path / "config.json")):
        config = load_config(path)
        assert config.model_type == "llama"
        assert config.num_hidden_layers == 3
    assert len(build_model(tmp_path).model.layers) == 3


def test_load_config_from_a_model_id_in_the_local_hub_cache(tmp_path, monkeypatch):
    """``org/name`` resolves to the cached snapshot's config.json (huggingface_hub's cache layout), offline."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = json.loads(json.dumps(load_config("tiny-llama").to_dict()))
    data["num_hidden_layers"] = 5
    repo = tmp_path / "models--acme--tiny-llama-5"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0123abcd")
    (repo / "snapshots" / "0123abcd").mkdir(parents=True)
    (repo / "snapshots" / "0123abcd" / "config.json").write_text(json.dumps(data))
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert load_config("acme/tiny-llama-5").num_hidden_layers == 5
    with pytest.raises(ValueError, match="local HuggingFace cache"):
        load_config("acme/not-downloaded")


def test_unknown_preset_error_lists_presets_and_paths():
    with pytest.raises(ValueError) as excinfo:
        load_config("gpt-5-ultra")
    message = str(excinfo.value)
    assert "gpt-5-ultra" in message
    assert "tiny-gpt2" in message and "llama-7b" in message
    assert "config.json" in message
    with pytest.raises(ValueError, match="available presets"):
        build_model("no/such/dir")


def test_config_without_model_type_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type"):
        load_config(tmp_path)


@pytest.mark.parametrize(("name", "limit"), [("tiny-gpt2", 128), ("tiny-bert", 128), ("llama-7b", 4096)])
def test_seq_len_beyond_max_positions_is_rejected(name, limit):
    assert max_positions(name) == limit
    make_example_inputs(name, 1, limit, device="meta")
    with pytest.raises(ValueError, match=f"maximum of {limit} positions"):
        make_example_inputs(name, 1, limit + 1)


def test_relative_position_models_have_no_limit():
    assert max_positions("t5-small") is None
    assert make_example_inputs("t5-small", 1, 4096, device="meta")["input_ids"].shape == (1, 4096)


@pytest.mark.parametrize("name", TINY)
def test_example_inputs_shapes_and_values(name):
    config = load_config(name)
    batch = make_example_inputs(config, batch_size=3, seq_len=20, seed=7)
    task = task_of(config)
    expected_keys = {"input_ids", "attention_mask", "labels"}
    if task == "masked-lm":
        expected_keys.add("token_type_ids")
    assert set(batch) == expected_keys
    assert "decoder_input_ids" not in batch
    for value in batch.values():
        assert value.dtype == torch.int64
        assert value.device.type == "cpu"
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == (3, 20)
    assert ids.min() >= 0 and ids.max() < config.vocab_size
    assert torch.equal(batch["attention_mask"], torch.ones_like(ids))
    if task == "causal-lm":
        assert torch.equal(labels, ids)
    elif task == "masked-lm":
        labelled = labels != -100
        assert labelled.sum(dim=1).tolist() == [3, 3, 3]  # 15% of 20
        assert torch.equal(labels[labelled], ids[labelled])
        assert torch.equal(batch["token_type_ids"], torch.zeros_like(ids))
    else:
        assert labels.shape == (3, 5)
        assert labels.min() >= 0 and labels.max() < config.vocab_size

    again = make_example_inputs(config, batch_size=3, seq_len=20, seed=7)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    other = make_example_inputs(config, batch_size=3, seq_len=20, seed=8)
    assert not torch.equal(batch["input_ids"], other["input_ids"])


@pytest.mark.parametrize("name", TINY)
def test_example_inputs_on_meta(name):
    meta = make_example_inputs(name, batch_size=2, seq_len=8, device="meta")
    cpu = make_example_inputs(name, batch_size=2, seq_len=8)
    assert set(meta) == set(cpu)
    for key, value in meta.items():
        assert value.device.type == "meta"
        assert value.shape == cpu[key].shape and value.dtype == cpu[key].dtype


def test_short_sequences():
    assert make_example_inputs("tiny-t5", 1, 3)["labels"].shape == (1, 1)
    labels = make_example_inputs("tiny-bert", 1, 2)["labels"]
    assert (labels != -100).sum() == 1
    with pytest.raises(ValueError, match=">= 1"):
        make_example_inputs("tiny-gpt2", 0, 8)

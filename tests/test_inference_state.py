"""A planned model keeps working across inference: KV caches under DTensor, generate(), then training again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torchrun_launch import run_torchrun
from transformers import Qwen2Config, Qwen2ForCausalLM

from hf_colossal_auto._torch_compat import fake_process_group, local_tensor_mode
from hf_colossal_auto.apply.dtensor_rules import register_runtime_rules
from hf_colossal_auto.apply.recompute import checkpoint_module
from hf_colossal_auto.solve.recompute import parse_option

ROOT = Path(__file__).resolve().parents[1]


def test_cat_onto_legacy_empty_tensor_keeps_the_dtensor_placement():
    """transformers' DynamicLayer starts from ``torch.tensor([])`` and concatenates head-sharded keys onto it:
    torch skips the ``(0,)`` tensor, DTensor tried to shard it on dim 1 (IndexError) before the runtime rule."""
    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(2)
    try:
        register_runtime_rules()
        with local_tensor_mode(2), implicit_replication():  # as the runtime runs (process-wide there)
            mesh = init_device_mesh("cpu", (2,))
            full = torch.randn(2, 4, 3, 8)
            keys = distribute_tensor(full, mesh, [Shard(1)])
            cached = torch.cat([torch.tensor([]), keys], dim=-2)
            assert isinstance(cached, DTensor) and cached.placements == (Shard(1),)
            grown = torch.cat([cached, keys], dim=-2)
            torch.testing.assert_close(grown.full_tensor(), torch.cat([full, full], dim=-2))
    finally:
        dist.destroy_process_group()


def test_recomputed_block_does_not_write_the_cache_twice():
    """A block checkpointed by the plan reruns its forward in backward; given the KV cache it appended its keys
    a second time (a 16-token step left a 32-token cache). It now trains without the cache, as HF's own
    gradient checkpointing does, and still fills it when no gradients are recorded (generate, eval)."""
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        use_cache=True,
    )
    model = Qwen2ForCausalLM(config).train()
    reference = Qwen2ForCausalLM(config).train()
    reference.load_state_dict(model.state_dict())
    for layer in model.model.layers:
        checkpoint_module(layer, parse_option("full"))
    ids = torch.randint(0, 64, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0
    reference(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with torch.no_grad():
        assert model(input_ids=ids).past_key_values.get_seq_length() == 16


@pytest.mark.slow
def test_generate_then_train_on_two_ranks_matches_one_process(tmp_path):
    """2 gloo ranks, a Qwen2 with ``use_cache`` on: a tensor-parallel plan (heads sharded, blocks recomputed)
    and a data-parallel one each train, generate greedily in eval mode (the same tokens as one process), train
    again, evaluate and train on a batch of another shape — with one process's losses at every step."""
    out = tmp_path / "result.json"
    run_torchrun(str(ROOT / "tests" / "multiproc" / "check_generate.py"), "--out", str(out))
    result = json.loads(out.read_text())
    assert result["tp"]["mesh"] == [1, 2] and result["tp"]["sharded_params"] > 0
    assert result["tp"]["recompute"] == ["full"]
    assert result["dp"]["mesh"] == [2, 1]
    for kind in ("tp", "dp"):
        assert len(result[kind]["losses"]) == 4
        for got, want in zip(result[kind]["losses"], result[kind]["reference_losses"], strict=True):
            assert got == pytest.approx(want, abs=1e-5), kind

"""The step at other batch sizes from three traces (capture/batch_rows.py): interpolated steps equal traced
ones field for field, and a step that does not scale linearly is traced at every size."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import ModelOutput

from hf_colossal_auto.capture import trace_training_step
from hf_colossal_auto.capture.batch_rows import NotAffine, TracesByRows, interpolate_step, same_step
from hf_colossal_auto.models import build_model, make_example_inputs
from hf_colossal_auto.solve.planner import plan_model


def _rows(batch: dict, rows: int) -> dict:
    return {k: v[:rows] if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in batch.items()}


@pytest.mark.parametrize("preset", ["tiny-gpt2", "tiny-t5", "tiny-mixtral"])
def test_interpolated_steps_equal_traced_ones(preset):
    """A decoder (GPT-2), an encoder-decoder (T5: two sequences, relative position bias) and an MoE (Mixtral:
    routed experts): the step at 8 rows interpolated from 2 and 4 is the traced step (shapes, FLOPs, bytes,
    memory events, op arguments), with bf16 autocast and the CUDA attention kernels. (Llama and BERT ran here
    too and passed; Llama's step is still interpolated below, in fp32, and by the planner.)"""
    model = build_model(preset, device="meta")
    batch = make_example_inputs(model, 8, 16, device="meta")
    traced = {
        r: trace_training_step(model, _rows(batch, r), mixed_precision="bf16", device_kind="cuda")
        for r in (2, 4, 8)
    }
    interpolated = interpolate_step(traced[2], 2, traced[4], 4, 8)
    assert same_step(interpolated, traced[8])
    assert not same_step(interpolated, traced[4])  # the comparison can fail


class _Contrastive(nn.Module):
    """A batch-contrastive loss: its logits are rows x rows, so its step grows with the square of the batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)

    def forward(self, input_ids: torch.Tensor) -> ModelOutput:
        pooled = self.embed(input_ids).mean(1)
        logits = pooled @ pooled.t()
        labels = torch.arange(logits.shape[0], device=logits.device)
        return ModelOutput(loss=nn.functional.cross_entropy(logits, labels))


def test_a_step_quadratic_in_the_batch_is_traced_at_every_size():
    model = _Contrastive().to("meta")
    batch = {"input_ids": torch.zeros(16, 4, dtype=torch.long, device="meta")}
    traces = TracesByRows(lambda rows: trace_training_step(model, _rows(batch, rows)))
    for rows in (2, 4, 8, 16):
        traces.get(rows)
    assert traces.traced == 4
    try:
        agrees = same_step(interpolate_step(traces.get(2), 2, traces.get(4), 4, 8), traces.get(8))
    except NotAffine:
        agrees = False
    assert not agrees


def test_affine_steps_are_traced_three_times_for_any_number_of_sizes():
    model = build_model("tiny-llama", device="meta")
    batch = make_example_inputs(model, 64, 8, device="meta")
    calls: list[int] = []

    def trace(rows: int):
        calls.append(rows)
        return trace_training_step(model, _rows(batch, rows))

    traces = TracesByRows(trace)
    for rows in (64, 1, 32, 16, 8, 4, 2):
        traces.get(rows)
    assert calls == [64, 1, 32, 16]  # two bases and the check; one row is always traced
    assert same_step(traces.get(2), trace(2))


def test_the_planner_traces_few_steps_for_many_batch_sizes():
    """A search over 16 devices prices the step at 1 to 16 rows per micro-batch; the plan says how many of
    those steps were traced."""
    model = build_model("tiny-llama", device="meta")
    batch = make_example_inputs(model, 16, 16, device="meta")
    plan = plan_model(model, batch, num_devices=16, device="a100-80gb", devices_per_node=8, micro_batches=1)
    assert plan.solver["batch_sizes"] >= 4
    assert plan.solver["steps_traced"] == 4

"""Sibling projections share one autocast cast of their input (apply/shared_casts.py), as the planner prices it
(capture/shared_casts.py): the same loss and gradients bit for bit, and the bytes backward keeps fall by what the
rewritten capture says."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from hf_colossal_auto import plan_model
from hf_colossal_auto._torch_compat import simulated_rank_tensors
from hf_colossal_auto.apply.enforce import enforce_projection_inputs
from hf_colossal_auto.apply.recompute import apply_recompute
from hf_colossal_auto.apply.shared_casts import share_sibling_casts
from hf_colossal_auto.apply.simulate import _CollectiveRecorder
from hf_colossal_auto.capture.graph import Phase
from hf_colossal_auto.capture.shared_casts import share_sibling_casts as share_in_graph
from hf_colossal_auto.capture.tracer import trace_training_step
from hf_colossal_auto.models import build_model, make_example_inputs


def _step(model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One bf16-autocast step: the loss, the gradients and the bytes of the distinct storages autograd saved."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with (
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())


def _kept_at_end_of_forward(preset: str, batch: dict, shared: bool) -> int:
    graph = trace_training_step(build_model(preset), batch, mixed_precision="bf16", fold_blocks=False)
    if shared:
        assert share_in_graph(graph) > 0
    start = graph.phase_range(Phase.BACKWARD).start
    return sum(e.delta for e in graph.memory_events if e.position < start)


def _assert_same(reference: tuple, run: tuple) -> None:
    assert torch.equal(run[0], reference[0])
    assert run[1].keys() == reference[1].keys()
    for name, grad in reference[1].items():
        torch.testing.assert_close(run[1][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-mixtral"])
def test_siblings_share_one_cast_with_the_same_gradients_and_keep_what_the_capture_says(preset):
    """q, k and v (gate and up in Llama's MLP) each cast the normed hidden states under autocast; hooked, they
    share one cast: bitwise the same loss and gradients, and the bytes backward keeps fall by exactly the
    rewritten capture's difference at the end of forward (Mixtral: attention only, its experts are no
    ``nn.Linear``)."""
    torch.manual_seed(0)
    reference = build_model(preset, device="cpu")
    batch = make_example_inputs(reference, 2, 16, seed=0)
    model = copy.deepcopy(reference)
    assert share_sibling_casts(model) > 0
    plain, shared = _step(reference, batch), _step(model, batch)
    _assert_same(plain, shared)
    predicted = _kept_at_end_of_forward(preset, batch, False) - _kept_at_end_of_forward(preset, batch, True)
    assert predicted > 0
    assert plain[2] - shared[2] == predicted


@pytest.mark.parametrize("option", ["full", "selective:pointwise"])
def test_shared_casts_under_recompute_give_the_same_gradients(option):
    """A recomputed block reruns its forward, hooks included (selective checkpointing replays the shared cast's
    ops as it recorded them): the gradients of the same blocks recomputed without the hooks."""
    torch.manual_seed(0)
    reference = build_model("tiny-llama", device="cpu")
    batch = make_example_inputs(reference, 2, 16, seed=0)
    plan = plan_model(
        build_model("tiny-llama"), batch, memory_budget=1 << 40, recompute="full", num_devices=1, device="cpu"
    )
    plan.recompute = dict.fromkeys(plan.recompute, option)
    runs = []
    for hooked in (False, True):
        model = copy.deepcopy(reference)
        if hooked:
            share_sibling_casts(model)
        apply_recompute(model, plan)
        runs.append(_step(model, batch))
    _assert_same(*runs)


def test_no_grad_and_fp32_forwards_are_unchanged():
    torch.manual_seed(0)
    reference = build_model("tiny-llama", device="cpu")
    batch = make_example_inputs(reference, 2, 16, seed=0)
    model = copy.deepcopy(reference)
    share_sibling_casts(model)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(**batch).logits, reference(**batch).logits)
    assert torch.equal(model(**batch).loss, reference(**batch).loss)  # no autocast: nothing cast


def test_the_capture_is_rewritten_only_where_the_runtime_shares():
    """No mixed precision: nothing cast, nothing rewritten. GPT-2's fused ``c_attn`` reads its input alone:
    nothing shared."""
    llama = build_model("tiny-llama")
    batch = make_example_inputs(llama, 2, 16)
    assert share_in_graph(trace_training_step(llama, batch, fold_blocks=False)) == 0
    gpt2 = build_model("tiny-gpt2")
    graph = trace_training_step(gpt2, make_example_inputs(gpt2, 2, 16), mixed_precision="bf16")
    assert share_in_graph(graph) == 0


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q_proj(x) * self.k_proj(x) + self.v_proj(x)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Attention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x)


def _column_parallel(dense: _Block, mesh) -> _Block:
    sharded = copy.deepcopy(dense)
    for linear in (sharded.attn.q_proj, sharded.attn.k_proj, sharded.attn.v_proj):
        linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(0)]))
    return sharded


def test_tensor_parallel_siblings_gather_once_and_cast_once(two_ranks):
    """Column-parallel q, k and v of a sequence-sharded input: one gather (the placement hooks' shared copy),
    then one cast of it kept for backward (this module's hooks, registered after), and the output and gradients
    of the same layout without the shared cast, bit for bit."""
    torch.manual_seed(0)
    dense = _Block()
    x = torch.randn(2, 16, 8)
    runs = []
    for hooked in (False, True):
        model = _column_parallel(dense, two_ranks)
        enforce_projection_inputs(model)
        if hooked:
            assert share_sibling_casts(model) == 3
        xd = distribute_tensor(x, two_ranks, [Shard(1)]).requires_grad_()
        recorder = _CollectiveRecorder()
        inputs_kept: set[int] = set()  # the storages of the bf16 matmul inputs backward keeps (rank 0's)

        def pack(t: torch.Tensor, kept: set[int] = inputs_kept) -> torch.Tensor:
            if isinstance(t, DTensor) and t.dtype == torch.bfloat16 and tuple(t.shape) == (32, 8):
                kept.add(simulated_rank_tensors(t)[0].untyped_storage().data_ptr())
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        with torch.autocast("cpu", dtype=torch.bfloat16), recorder, hooks:
            out = model(xd)
        out.to_local().float().sum().backward()
        grads = [xd.grad.full_tensor(), *(p.grad.full_tensor() for p in model.parameters())]
        runs.append((recorder.counts.get("all_gather", 0), len(inputs_kept), out.full_tensor(), *grads))
    plain, shared = runs
    assert plain[0] == shared[0] == 1  # one gather either way
    assert plain[1] == 3 and shared[1] == 1  # three casts of the gathered input kept, then one
    for a, b in zip(plain[2:], shared[2:], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_the_rewrite_holds_for_folded_blocks():
    """The planner traces a few copies of a run of identical blocks and replays them (``profile.memory.unroll``):
    rewritten, the folded step's memory timeline equals the rewritten full trace's, peak and end of forward."""
    from hf_colossal_auto.models import load_config
    from hf_colossal_auto.profile.memory import unroll

    config = load_config("tiny-llama")
    config.num_hidden_layers = 8
    model = build_model(config)
    batch = make_example_inputs(model, 2, 16)

    def timeline(fold: bool) -> tuple[int, int, int]:
        graph = trace_training_step(model, batch, mixed_precision="bf16", fold_blocks=fold)
        assert bool(graph.block_runs) == fold
        aliases = share_in_graph(graph)
        step = unroll(graph)
        first_backward = next(i for i, n in enumerate(step.order) if graph.nodes[n].phase is Phase.BACKWARD)
        live = peak = step.initial_bytes
        at_end = None
        for position, delta, _ in step.events:
            if at_end is None and position >= first_backward:
                at_end = live
            live += delta
            peak = max(peak, live)
        return aliases, peak, at_end

    (traced, *full), (folded, *replayed) = timeline(False), timeline(True)
    assert traced == 3 * 8 and 0 < folded < traced  # three casts shared a block, in the traced blocks only
    assert replayed == full

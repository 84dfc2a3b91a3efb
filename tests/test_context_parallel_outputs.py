"""Context parallelism's lazy outputs (``apply/context_parallel_outputs.py``) in one process: a one-rank cp
group (the gather is the identity, the read tag is skipped), so that every way of reading a transformers
``ModelOutput`` can be checked to gather each field exactly once, with the forward's autograd; the multi-rank
behaviour (no gather when only the loss is read, unlike reads stopped by name) is in ``test_context_parallel.py``.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from multiproc.common import all_gathers
from transformers.modeling_outputs import CausalLMOutputWithPast

from hf_colossal_auto.apply.context_parallel_attention import ContextParallel, ContextParallelError
from hf_colossal_auto.apply.context_parallel_outputs import (
    OutputDeferral,
    PendingField,
    defer_outputs,
    install_output_deferral,
    is_gathered_when_read,
    read_timeout_s,
    transform_fields,
)

ROWS, SEQ, VOCAB = 2, 4, 3


@pytest.fixture(scope="module")
def cp():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield ContextParallel(
        group=dist.group.WORLD, size=1, rank=0, base_attention="sdpa", device=torch.device("cpu")
    )
    dist.destroy_process_group()


@pytest.fixture
def gathers():
    """Every ``dist.all_gather_into_tensor`` call (the lazy gathers), by its output's elements."""
    with all_gathers() as seen:
        yield seen


def _defer(cp, output, grad_enabled: bool = True):
    """``output`` as the first forward of a training step returns it on a cp rank of ``ROWS x SEQ`` tokens."""
    return defer_outputs(
        output,
        cp=cp,
        length=SEQ,
        rows=ROWS,
        order=torch.arange(SEQ),
        forward_index=1,
        grad_enabled=grad_enabled,
        inference=False,
    )


def _lazy(cp, weight: torch.Tensor, grad_enabled: bool = True):
    logits = torch.arange(ROWS * SEQ * VOCAB, dtype=torch.float32).view(ROWS, SEQ, VOCAB) * weight
    hidden = (torch.ones(ROWS, SEQ, 5), torch.zeros(ROWS, SEQ, 5))
    output = CausalLMOutputWithPast(loss=logits.sum(), logits=logits, hidden_states=hidden)
    return _defer(cp, output, grad_enabled), logits


def test_every_read_gathers_each_field_once(cp, gathers):
    """The model's own class (a subclass), the loss at once, each token-wise field gathered on its first read
    by any route (attribute, key, index, slice, ``get``, ``to_tuple``, ``dict()``, ``**``, ``values``, ``items``,
    equality) and never again; keys, ``in`` and ``repr`` read nothing."""
    lazy, logits = _lazy(cp, torch.ones(VOCAB))
    assert isinstance(lazy, CausalLMOutputWithPast) and is_gathered_when_read(lazy)
    assert list(lazy.keys()) == ["loss", "logits", "hidden_states"] and "logits" in lazy
    assert "gathered over the 1 cp ranks when read" in repr(lazy) and gathers == []
    assert torch.equal(lazy.loss, logits.sum()) and gathers == []
    first = lazy[1]
    assert torch.equal(first, logits) and gathers == [ROWS * SEQ * VOCAB]
    assert lazy.logits is first and lazy["logits"] is first and lazy.get("logits") is first
    assert lazy[0:2][1] is first and lazy.to_tuple()[1] is first and dict(lazy)["logits"] is first
    assert len(gathers) == 3  # dict() read the two hidden states too
    assert {**lazy}["hidden_states"][0] is lazy.hidden_states[0]
    assert list(lazy.values())[1] is first and dict(lazy.items())["logits"] is first
    assert lazy == lazy and len(gathers) == 3
    assert lazy.get("attentions") is None and lazy.get("missing", 7) == 7
    with pytest.raises(KeyError):
        lazy["attentions"]


def test_pickle_copy_and_pytree_read_everything(cp, gathers):
    """Pickling and ``copy`` give the model's own class with every field gathered; a pytree flattens gathered
    tensors (no :class:`PendingField` leaks out)."""
    lazy, logits = _lazy(cp, torch.ones(VOCAB))
    again = pickle.loads(pickle.dumps(lazy))
    assert type(again) is CausalLMOutputWithPast and torch.equal(again.logits, logits)
    assert type(lazy.copy()) is CausalLMOutputWithPast
    lazy, _ = _lazy(cp, torch.ones(VOCAB))
    leaves, _ = pytree.tree_flatten(lazy)
    assert all(isinstance(leaf, torch.Tensor) for leaf in leaves) and len(leaves) == 4
    assert type(copy.copy(lazy)) is CausalLMOutputWithPast


def test_read_keeps_the_forwards_autograd(cp):
    """Read under ``no_grad`` after a forward with gradients: the gathered logits still carry the graph, and
    their gradient reaches the forward's tensors; a forward without gradients gives none."""
    weight = torch.ones(VOCAB, requires_grad=True)
    lazy, logits = _lazy(cp, weight)
    with torch.no_grad():
        read = lazy.logits
    assert read.requires_grad
    read.sum().backward()
    assert torch.equal(weight.grad, logits.detach().sum((0, 1)))
    with torch.no_grad():
        lazy, _ = _lazy(cp, weight, grad_enabled=False)
    assert not lazy.logits.requires_grad


def test_setting_a_field_replaces_the_pending_one(cp, gathers):
    lazy, _ = _lazy(cp, torch.ones(VOCAB))
    lazy.logits = torch.zeros(1)
    assert torch.equal(lazy["logits"], torch.zeros(1)) and gathers == []


def test_transform_fields_composes_after_the_gather(cp, gathers):
    """A transform of every field (the first-call wrapper's row cut) runs after a pending field's gather, on
    its read; on other fields at once."""
    lazy, logits = _lazy(cp, torch.ones(VOCAB))
    transform_fields(lazy, lambda v: v[:1] if isinstance(v, torch.Tensor) and v.dim() else v)
    assert gathers == [] and isinstance(lazy.__dict__["logits"], PendingField)
    assert torch.equal(lazy.logits, logits[:1]) and gathers == [ROWS * SEQ * VOCAB]


def test_tuple_outputs_gather_at_once(cp, gathers):
    """A tuple output (``return_dict=False``) cannot defer a read: its token-wise tensors gather at once."""
    logits = torch.ones(ROWS, SEQ, VOCAB)
    out = _defer(cp, (torch.tensor(1.0), logits))
    assert torch.equal(out[1], logits) and gathers == [ROWS * SEQ * VOCAB]


def test_forward_hooks_see_this_ranks_output(cp):
    """Inside ``model(...)`` the forward's output stays this rank's (hooks that visit every tensor, FSDP2's or
    MemTracker's, must not gather); the caller gets the lazy one, and a direct ``forward`` call defers at once.
    The model keeps its class name."""
    state = OutputDeferral()

    class Tiny(torch.nn.Module):
        def forward(self, x):
            return state.finish(CausalLMOutputWithPast(logits=x * 2), cp, SEQ, ROWS)

    from hf_colossal_auto.apply.context_parallel_attention import StepLayout

    order = torch.arange(SEQ)
    cp.layout = StepLayout(order, order, order, None, None)
    model = Tiny()
    install_output_deferral(model, state)
    seen = []
    model.register_forward_hook(lambda m, i, o: seen.append(is_gathered_when_read(o)))
    out = model(torch.ones(ROWS, SEQ, VOCAB))
    assert seen == [False] and is_gathered_when_read(out) and type(model).__name__ == "Tiny"
    assert is_gathered_when_read(model.forward(torch.ones(ROWS, SEQ, VOCAB)))
    assert state.forwards == 2 and state.stashed is None


def test_read_timeout_setting(monkeypatch):
    monkeypatch.setenv("HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S", "2.5")
    assert read_timeout_s() == 2.5
    monkeypatch.setenv("HF_COLOSSAL_AUTO_CP_READ_TIMEOUT_S", "soon")
    with pytest.raises(ContextParallelError, match="not a number of seconds"):
        read_timeout_s()

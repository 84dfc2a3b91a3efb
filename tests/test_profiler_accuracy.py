"""The profiler's figures against a real training step of the same model.

Every check builds a small *real* CPU model, profiles it symbolically (``device="cpu"``, so that the traced
attention kernels are the ones this host runs) and then runs the step for real:

* FLOPs: ``FlopCounterMode`` over a real forward + backward must count exactly ``report.total_flops``;
* memory: ``MemTracker``'s peak over a real steady-state step (forward, backward, ``AdamW(foreach)`` step, with
  the optimizer state already allocated) against ``report.peak_memory_bytes``: never more than 0.01 % under it
  (a plan priced below what it uses could break its budget), at most 0.05 % over it (0.12 % for the
  long-sequence case);
* folding: tracing a few blocks and replaying them must give exactly what tracing every block gives;
* scale: a meta-device Llama-7B profiles without touching real memory.

Models have 7 blocks (5 for the second size) so that block folding triggers (it needs >= 5 identical blocks).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from hf_colossal_auto.models import build_model, load_config, make_example_inputs
from hf_colossal_auto.profile import EXTRA_FLOP_FORMULAS, profile_model

# Bounds on predicted / measured - 1, from the ratios these checks measured (torch 2.13, docs/benchmarks.md):
# every case over-predicts, by +0.0038 % (T5 wide) to +0.025 % (BERT small), +0.108 % for the long-sequence
# Llama. Under-prediction is the side that breaks budgets, so it gets the smaller margin.
MEMORY_UNDER = 1e-4
MEMORY_OVER = 5e-4
MEMORY_OVER_LONG_SEQUENCE = 1.2e-3
FAMILIES = ["gpt2", "bert", "t5", "llama"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The real steps here are tiny: one intra-op thread avoids OpenMP spinning on a shared 2-core box
    (several times faster there), and changes no FLOP count or allocation."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def small_config(family: str, *, layers: int, hidden: int, heads: int = 4, ffn: int | None = None):
    """The tiny preset of ``family`` resized: ``layers`` blocks (encoder and decoder for T5), width ``hidden``."""
    config = load_config(f"tiny-{family}")
    ffn = ffn or 2 * hidden
    if family == "gpt2":
        config.n_layer, config.n_embd, config.n_head, config.n_inner = layers, hidden, heads, ffn
    elif family == "t5":
        config.num_layers = config.num_decoder_layers = layers
        config.d_model, config.num_heads, config.d_kv, config.d_ff = hidden, heads, hidden // heads, ffn
    else:
        config.num_hidden_layers, config.hidden_size = layers, hidden
        config.num_attention_heads, config.intermediate_size = heads, ffn
        if family == "llama":
            config.num_key_value_heads = heads // 2  # grouped-query attention, as in Llama 2/3
    return config


def _autocast(mixed_precision: str | None):
    if mixed_precision is None:
        return contextlib.nullcontext()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
    return torch.autocast("cpu", dtype=dtype)


def measure_real_step(model, batch, mixed_precision=None, flop_mapping=EXTRA_FLOP_FORMULAS):
    """(FLOPs of a real forward+backward, MemTracker peak bytes of a real steady-state step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    # Warm-up step, counted: afterwards the optimizer state exists, as in the profiled steady state.
    counter = (
        FlopCounterMode(display=False, custom_mapping=flop_mapping)
        if flop_mapping is not None
        else FlopCounterMode(display=False)
    )
    with counter:
        with _autocast(mixed_precision):
            loss = model(**batch).loss
        loss.backward()
    del loss
    opt.step()
    opt.zero_grad(set_to_none=True)

    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        with _autocast(mixed_precision):
            loss = model(**batch).loss
        loss.backward()
        del loss
        opt.step()
    opt.zero_grad(set_to_none=True)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    return counter.get_total_flops(), peak


# Two sizes per family: 7 narrow blocks on a short batch, and 5 blocks twice as wide with more heads on a
# larger batch. Folding needs >= 5 identical blocks; T5's first block (it owns the relative-position bias)
# differs from the others, so T5 gets one block more.
SIZES = {
    "small": dict(layers=7, hidden=64, heads=4, batch=2, seq=32),
    "wide": dict(layers=5, hidden=128, heads=8, batch=4, seq=24),
}


def _layers(family: str, size: str) -> int:
    return SIZES[size]["layers"] + (1 if family == "t5" and SIZES[size]["layers"] < 6 else 0)


CASES = [(f, s) for f in FAMILIES for s in SIZES]


@pytest.fixture(scope="module")
def measured():
    """Cache: (family, size) -> (model config, batch, folded report, real FLOPs, real peak)."""
    cache: dict = {}

    def get(family: str, size: str):
        key = (family, size)
        if key not in cache:
            s = SIZES[size]
            config = small_config(family, layers=_layers(family, size), hidden=s["hidden"], heads=s["heads"])
            torch.manual_seed(0)
            model = build_model(config, device="cpu")
            batch = make_example_inputs(model, s["batch"], s["seq"])
            report = profile_model(model, batch, device="cpu")
            flops, peak = measure_real_step(model, batch)
            cache[key] = (config, batch, report, flops, peak)
        return cache[key]

    return get


def _assert_peak_close(predicted: int, measured: int, case: str, over: float = MEMORY_OVER) -> None:
    """``predicted`` within ``[-MEMORY_UNDER, +over]`` of ``measured`` (relative), the ratio in the message."""
    error = predicted / measured - 1
    message = f"{case}: predicted {predicted} B, measured {measured} B ({error:+.4%})"
    assert error >= -MEMORY_UNDER, "under-predicted: " + message
    assert error <= over, "over-predicted: " + message


@pytest.mark.parametrize("family,size", CASES)
def test_flops_match_flop_counter_exactly(measured, family, size):
    _, _, report, real_flops, _ = measured(family, size)
    assert report.folded_blocks > 0
    assert real_flops > 0
    assert report.total_flops == real_flops
    assert report.forward_flops + report.backward_flops == report.total_flops
    # Backward of a matmul costs twice its forward; embeddings and norms add none.
    assert 1.5 * report.forward_flops < report.backward_flops <= 2.1 * report.forward_flops


@pytest.mark.parametrize("family,size", CASES)
def test_peak_memory_within_tolerance(measured, family, size):
    _, _, report, _, real_peak = measured(family, size)
    floor = report.param_bytes + report.optimizer_state_bytes
    assert real_peak > floor  # the measurement saw the step, not just the model
    _assert_peak_close(report.peak_memory_bytes, real_peak, f"{family}/{size}")


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_eager_attention_flops_match_plain_flop_counter(family):
    """Eager attention is plain bmm/softmax: torch's own FlopCounterMode, with no custom formulas, agrees."""
    config = small_config(family, layers=7, hidden=64)
    torch.manual_seed(0)
    model = build_model(config, device="cpu", attn_implementation="eager")
    batch = make_example_inputs(model, 2, 16)
    report = profile_model(model, batch, device="cpu")
    real_flops, _ = measure_real_step(model, batch, flop_mapping=None)
    assert report.folded_blocks > 0
    assert report.total_flops == real_flops
    # No SDPA in the model: the traced attention kernels of a GPU target change nothing.
    assert profile_model(model, batch, device="a100-80gb").total_flops == real_flops


def test_bf16_autocast_flops_and_peak():
    config = small_config("llama", layers=7, hidden=128)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    batch = make_example_inputs(model, 2, 16)
    report = profile_model(model, batch, device="cpu", mixed_precision="bf16")
    fp32 = profile_model(model, batch, device="cpu")
    real_flops, real_peak = measure_real_step(model, batch, mixed_precision="bf16")
    assert report.mixed_precision == "bf16"
    assert report.total_flops == real_flops
    _assert_peak_close(report.peak_memory_bytes, real_peak, "llama/bf16")
    # Autocast keeps fp32 weights (same parameter bytes) and runs the matmuls in bf16.
    assert report.param_bytes == fp32.param_bytes
    assert report.total_flops == fp32.total_flops
    mm_dtypes = {
        report.graph.values[n.outputs[0]].dtype for n in report.graph.nodes if n.op == "aten.mm.default"
    }
    assert mm_dtypes == {"bfloat16"}


def test_llama_all_ones_mask_peak_matches_eager():
    """Eager transformers skips the causal mask when nothing is masked (SDPA runs with is_causal); under fake
    tensors it cannot read values and would build a batch x 1 x seq x seq mask per step unless the capture
    decides as eager does (capture/hf_masks.py). Visible once seq is large against hidden."""
    config = small_config("llama", layers=2, hidden=64)
    torch.manual_seed(0)
    model = build_model(config, device="cpu")
    batch = make_example_inputs(model, 2, 128)
    assert bool(batch["attention_mask"].all())
    report = profile_model(model, batch, device="cpu")
    _, real_peak = measure_real_step(model, batch)
    _assert_peak_close(report.peak_memory_bytes, real_peak, "llama/long-seq", over=MEMORY_OVER_LONG_SEQUENCE)


# ---------------------------------------------------------------------------------------------- folding
def _block_figures(report):
    return [
        (
            b.name,
            b.num_params,
            b.param_bytes,
            b.forward_flops,
            b.backward_flops,
            b.saved_bytes,
            b.output_bytes,
        )
        for b in report.blocks
    ]


@pytest.mark.parametrize(
    "family,device,mixed_precision",
    [(f, "cpu", None) for f in FAMILIES] + [("llama", "a100-80gb", "bf16"), ("gpt2", "a100-80gb", "fp16")],
)
def test_folding_is_exact(family, device, mixed_precision):
    config = small_config(family, layers=7, hidden=64)
    model = build_model(config, device="meta")
    batch = make_example_inputs(model, 2, 32, device="meta")
    folded = profile_model(model, batch, device=device, mixed_precision=mixed_precision)
    full = profile_model(model, batch, device=device, mixed_precision=mixed_precision, fold_blocks=False)
    assert folded.folded_blocks > 0
    assert full.folded_blocks == 0
    assert folded.num_traced_ops < full.num_traced_ops
    assert folded.num_ops == full.num_ops == full.num_traced_ops
    assert folded.total_flops == full.total_flops
    assert folded.forward_flops == full.forward_flops
    assert folded.peak_memory_bytes == full.peak_memory_bytes
    assert folded.peak_breakdown == full.peak_breakdown
    assert folded.activation_bytes == full.activation_bytes
    assert folded.peak_activation_bytes == full.peak_activation_bytes
    assert folded.optimizer_state_bytes == full.optimizer_state_bytes
    assert _block_figures(folded) == _block_figures(full)
    for a, b in zip(folded.blocks, full.blocks, strict=True):
        assert a.forward_time_s == pytest.approx(b.forward_time_s, rel=1e-9)
        assert a.backward_time_s == pytest.approx(b.backward_time_s, rel=1e-9)
    assert folded.estimated_step_time_s == pytest.approx(full.estimated_step_time_s, rel=1e-9)
    assert sum(1 for b in folded.blocks if b.traced_as) == folded.folded_blocks + len(folded.graph.block_runs)


# ---------------------------------------------------------------------------------------------- scale
def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset VmHWM (Linux >= 4.0); False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def test_llama_7b_on_meta_profiles_without_real_memory():
    seq = 4096
    rss_before = _rss_bytes()
    can_track_peak = _reset_peak_rss()
    model = build_model("llama-7b", device="meta")
    batch = make_example_inputs(model, 1, seq, device="meta")
    report = profile_model(model, batch)
    growth = _rss_bytes() - rss_before

    numel = sum(p.numel() for p in model.parameters())
    model_bytes = 4 * numel
    assert 6.5e9 < numel < 7e9
    assert report.param_bytes == model_bytes
    assert report.grad_bytes == model_bytes
    assert report.optimizer_state_bytes >= 2 * model_bytes  # AdamW: exp_avg and exp_avg_sq
    assert report.peak_memory_bytes > 4 * model_bytes
    assert report.folded_blocks == model.config.num_hidden_layers - 4

    limit = 2 * 2**30
    assert growth < limit, f"RSS grew by {growth / 2**30:.2f} GiB for a {model_bytes / 2**30:.0f} GiB model"
    if can_track_peak:
        assert _peak_rss_bytes() - rss_before < limit

    # Exact FLOPs from the config: every Linear costs 6 * tokens * in * out over forward + backward (all
    # their inputs need grads), SDPA costs torch's formulas, nothing else in Llama has a FLOP formula.
    c = model.config
    tokens = seq
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = c.hidden_size // c.num_attention_heads
    q = (1, c.num_attention_heads, seq, head_dim)
    forward = 2 * tokens * linear + c.num_hidden_layers * sdpa_flop_count(q, q, q)
    backward = 4 * tokens * linear + c.num_hidden_layers * sdpa_backward_flop_count(q, q, q, q)
    assert (report.forward_flops, report.backward_flops) == (forward, backward)

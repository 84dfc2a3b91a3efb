import os

# Set before anything imports transformers / huggingface_hub: tests never touch the network or the Hub, and
# never run the (slow, machine-specific) hardware calibration.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_COLOSSAL_AUTO_NO_CALIBRATE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every process a test launches (torchrun / accelerate ranks) inherits these: a rank killed by a signal (gloo's
# C++ abort, a segfault) prints every thread's Python stack and the C++ one, which a failed launch's message
# quotes (tests/torchrun_launch.py, why_it_failed) — a bare "Signal 6 received" names nothing to fix.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# `make test` runs the files on parallel workers (pytest-xdist): share the cores between them instead of
# oversubscribing — the multi-process launches already set OMP_NUM_THREADS=1 per rank.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, (os.cpu_count() or 2) // _WORKERS))


@pytest.fixture(autouse=True)
def _seed_torch():
    torch.manual_seed(0)


@pytest.fixture
def tiny_model():
    """Factory: `tiny_model("tiny-gpt2", seed=0, **build_model_kwargs)` -> a real, seeded CPU model in train mode."""
    from hf_colossal_auto.models import build_model

    def make(name: str = "tiny-gpt2", *, seed: int = 0, **kwargs):
        if not name.startswith("tiny-"):
            raise ValueError(f"tiny_model builds tiny presets only (real weights on CPU), got {name!r}")
        torch.manual_seed(seed)
        return build_model(name, device="cpu", **kwargs)

    return make


@pytest.fixture(autouse=True, scope="module")
def _no_leaked_process_group():
    """The planner starts an in-process fake process group when none exists; end it with the module so that
    tests which need no group (or a real gloo one) never inherit it."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def two_ranks():
    """Two ranks simulated in this process (a fake process group, ``LocalTensorMode``): their 1-D CPU mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_colossal_auto._torch_compat import fake_process_group, local_tensor_mode

    if dist.is_initialized():
        dist.destroy_process_group()
    fake_process_group(2)
    try:
        with local_tensor_mode(2):
            yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()

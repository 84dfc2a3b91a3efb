"""Loading never executes code from a checkpoint directory: DCP's own reader unpickles ``.metadata`` with plain
``pickle``, so every sharded load of ours reads it through :class:`SafeFileSystemReader`."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from hf_colossal_auto.apply.checkpoint import UnsafeCheckpointError, load_checkpoint, save_checkpoint


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch ran-from-checkpoint",))


def test_a_checkpoint_loads_and_a_crafted_metadata_is_refused(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    save_checkpoint(model, optimizer, tmp_path / "good")
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(4, 3)).sum().backward()
    fresh_optimizer.step()
    load_checkpoint(fresh, fresh_optimizer, tmp_path / "good")
    torch.testing.assert_close(fresh.weight, model.weight, rtol=0, atol=0)
    assert fresh_optimizer.state_dict()["state"][0]["exp_avg"].equal(
        optimizer.state_dict()["state"][0]["exp_avg"]
    )

    crafted = tmp_path / "crafted"
    crafted.mkdir()
    (crafted / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata names posix\.system"):
        load_checkpoint(fresh, fresh_optimizer, crafted)
    assert not (tmp_path / "ran-from-checkpoint").exists()

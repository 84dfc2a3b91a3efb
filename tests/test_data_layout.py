"""The batch rule (integrations/data.py) in one process: a loader prepared as plain accelerate prepares it for
process r of a job, then re-cut for r's tensor-parallel group, yields at every step the union of the batches
plain accelerate gives the group's processes; gathers keep one copy of what a group shares."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from hf_colossal_auto.integrations.data import (
    gather_for_metrics,
    one_copy_per_group,
    regroup_loader,
    tensor_parallel_members,
)


@pytest.fixture(scope="module", autouse=True)
def one_process_state():
    """The process state accelerate's loaders read (one process, no group)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    Accelerator(cpu=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


class _Stream(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


def _batches(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


CASES = [
    dict(dp=dp, tp=tp, drop_last=drop, even_batches=even, split_batches=split, iterable=iterable)
    for dp, tp, drop, even, split, iterable in itertools.product(
        (1, 2), (2, 3), (False, True), (True, False), (False, True), (False, True)
    )
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={int(v)}" for k, v in c.items()))
def test_a_group_reads_the_union_of_its_processes_batches(case):
    """Shuffled map-style and iterable datasets, drop_last, even_batches (the uneven last batch completed or
    not), split_batches: every step of every group is plain accelerate's rows for its processes, in rank
    order, and the loader's length is plain accelerate's."""
    from accelerate.data_loader import prepare_data_loader

    world, per = case["dp"] * case["tp"], 3
    n = per * world * 3 + 5  # an uneven last step
    batch_size = per * world if case["split_batches"] else per

    def loader() -> DataLoader:
        if case["iterable"]:
            return DataLoader(_Stream(n), batch_size=batch_size, drop_last=case["drop_last"])
        data = list(range(n))
        generator = torch.Generator().manual_seed(7)
        return DataLoader(
            data, batch_size=batch_size, shuffle=True, drop_last=case["drop_last"], generator=generator
        )

    options = dict(
        split_batches=case["split_batches"], even_batches=case["even_batches"], dispatch_batches=False
    )
    plain = [
        prepare_data_loader(loader(), num_processes=world, process_index=r, **options) for r in range(world)
    ]
    rows = [_batches(p) for p in plain]
    for rank in range(world):
        members = tensor_parallel_members(rank, case["tp"])
        ours = prepare_data_loader(loader(), num_processes=world, process_index=rank, **options)
        regroup_loader(ours, members)
        expected = [
            [i for part in parts if part is not None for i in part]
            for parts in itertools.zip_longest(*(rows[m] for m in members))
        ]
        assert _batches(ours) == expected
        assert len(ours) == max(len(plain[m]) for m in members)


def test_a_loader_is_recut_from_its_next_epoch():
    """Re-cut while an epoch is being read (the plan made at the model's first call): that epoch goes on with
    this process's batches; the next one yields the group's."""
    from accelerate.data_loader import prepare_data_loader

    def loader() -> DataLoader:
        return DataLoader(list(range(16)), batch_size=2)

    mine = prepare_data_loader(loader(), num_processes=2, process_index=0)
    other = _batches(prepare_data_loader(loader(), num_processes=2, process_index=1))
    epoch = iter(mine)
    first = next(epoch).tolist()
    regroup_loader(mine, (0, 1))
    assert [first, *[b.tolist() for b in epoch]] == _batches(
        prepare_data_loader(loader(), num_processes=2, process_index=0)
    )
    assert _batches(mine) == [a + b for a, b in zip([[0, 1], [4, 5], [8, 9], [12, 13]], other, strict=True)]


def test_a_resumed_loader_skips_group_steps():
    """accelerate's skip_first_batches (how a resumed job skips the steps it trained) over a re-cut loader
    skips whole steps of the group: the rest of the epoch is the group's steps after them."""
    from accelerate.data_loader import prepare_data_loader, skip_first_batches

    def loader() -> DataLoader:
        return DataLoader(
            list(range(40)), batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)
        )

    grouped = prepare_data_loader(loader(), num_processes=4, process_index=2)
    regroup_loader(grouped, (2, 3))
    steps = _batches(grouped)
    assert (
        _batches(skip_first_batches(prepare_data_loader(loader(), num_processes=4, process_index=2), 0))
        != steps
    )
    resumed = prepare_data_loader(loader(), num_processes=4, process_index=2)
    regroup_loader(resumed, (2, 3))
    assert _batches(skip_first_batches(resumed, 3)) == steps[3:]


def test_gathers_keep_one_copy_of_what_a_group_shares():
    """4 processes, tp=2: rows a group's processes share are kept once, in rank order (what plain accelerate
    gathers from the processes' own batches); values that differ within a group (a process index) are kept
    from every process; the last batch's padding is cut by accelerate's remainder."""
    shared = torch.tensor([0, 1, 0, 1, 2, 3, 2, 3])  # groups (0, 1) and (2, 3) each hold two rows
    assert one_copy_per_group({"x": shared}, 4, 2)["x"].tolist() == [0, 1, 2, 3]
    own = torch.tensor([0, 1, 2, 3])  # gather(torch.tensor([process_index]))
    assert one_copy_per_group(own, 4, 2).tolist() == [0, 1, 2, 3]
    assert one_copy_per_group([["a"], ["a"], ["b"], ["b"]][0] + ["a", "b", "b"], 4, 2, objects=True) == [
        "a",
        "b",
    ]
    assert one_copy_per_group(shared, 4, 1) is shared
    # with the group's batch rows known (2 per group here: 1 per process), only values of that many rows are
    # per sample of the group's batch; a batch loss repeated once per process row (transformers' examples:
    # gather_for_metrics(loss.repeat(per_device_batch))) is kept from every process, plain accelerate's count
    assert one_copy_per_group(shared, 4, 2, group_rows=2).tolist() == [0, 1, 2, 3]
    repeated_loss = torch.tensor([5.0, 5.0, 7.0, 7.0])  # each process: its group's loss, one per-process row
    assert one_copy_per_group(repeated_loss, 4, 2, group_rows=2).tolist() == [5.0, 5.0, 7.0, 7.0]
    assert one_copy_per_group(repeated_loss, 4, 2).tolist() == [5.0, 7.0]  # rows unknown: equal copies once
    state = SimpleNamespace(end_of_dataloader=True, remainder=3, active_dataloader=None)
    accelerator = SimpleNamespace(num_processes=4, gradient_state=state)
    import accelerate.utils

    original = accelerate.utils.gather
    accelerate.utils.gather = lambda t: shared
    try:
        assert gather_for_metrics(accelerator, torch.zeros(2), 2).tolist() == [0, 1, 2]
    finally:
        accelerate.utils.gather = original


# ------------------------------------------------------------------------------------------- 2 processes
@pytest.mark.slow
def test_every_step_trains_on_plain_accelerates_rows_under_any_plan(tmp_path):
    """One torchrun launch (tests/multiproc/check_data_rows.py): a shuffled loader whose sampler accelerate
    seeds from the global RNG, with an uneven last step, under plain accelerate and under 1x2, 2x1 and a 1x2
    plan in 2 micro-batches (gradient_accumulation_steps=2): every step's rows (gathered, each sample once),
    the number of batches, the losses (fp32, no dropout) and an evaluation's gather_for_metrics are plain
    accelerate's."""
    import json

    from torchrun_launch import run_torchrun

    out = tmp_path / "rows.json"
    script = str(Path(__file__).resolve().parent / "multiproc" / "check_data_rows.py")
    run_torchrun(script, "--out", str(out), timeout=600, env={"ACCELERATE_USE_CPU": "1"})
    runs = json.loads(out.read_text())
    assert runs["1x2/1"]["mesh"] == [1, 2] and runs["2x1/1"]["mesh"] == [2, 1]
    assert runs["1x2/2"]["micro_batches"] == 2
    for name, run in runs.items():
        plain = runs[f"plain/{name.split('/')[1]}"]
        assert run["rows"] == plain["rows"], name
        assert run["batches"] == plain["batches"] == len(plain["rows"]), name
        assert run["losses"] == pytest.approx(plain["losses"], abs=1e-5), name
        assert run["eval_rows"] == list(range(11)), name
    first = runs["plain/1"]["rows"]  # 27 rows: 3 full steps of 8, and 3 rows completed to 8 by even_batches
    assert [len(step) for step in first] == [8, 8, 8, 8]
    assert {i for step in first for i in step} == set(range(27))

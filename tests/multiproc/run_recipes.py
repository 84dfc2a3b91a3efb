"""Run several pretraining recipes one after the other in the same processes (one ``accelerate launch``).

    ACCELERATE_USE_CPU=1 accelerate launch --config_file recipes/auto_cpu.yaml --multi_gpu --num_processes 2 \\
        tests/multiproc/run_recipes.py '[["pretrain_bert", ["--output_dir", "out/bert", ...], {"VAR": "value"}], ...]'

Each recipe runs exactly as its script's ``__main__`` would (``run(RECIPE, argv)``: parse, plan at prepare,
train, export, ``end_training``; ``main(argv)`` for a script without a ``Recipe``, such as the fine-tuning one), with the variables of its third item set while it runs (e.g.
``HF_COLOSSAL_AUTO_SAVE_PLAN_PATH``, so that each recipe writes its own plan). Why one launch for several: starting the processes, importing
torch/transformers and rendezvousing cost more than a tiny recipe's training on 2 cores, so a test that needs
several recipes under a plan pays that once.

Between recipes the accelerate singletons are cleared, as a fresh script would find them, and a new process
group is started on a fresh key prefix of the launcher's store. Why not let the next ``Accelerator`` start it:
``end_training`` destroyed the old group, and re-initialising the default group reuses its store keys
("default_pg/0/..."), so a rank could read the peer address its partner published for the old group and both
wait forever (seen: a barrier hung in the second recipe). The next ``Accelerator`` finds the group started and
uses it, as accelerate does with any group started before it.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

from hf_colossal_auto.integrations.process_exit import finish

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))


def _start_group(run: int) -> None:
    """The default gloo group on keys of its own (``recipe<run>/``) in the store torchrun's agent serves; in a
    single process (no launcher) there is none to start."""
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        return

    world = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"recipe{run}/", store), rank=int(os.environ["RANK"]), world_size=world
    )


def main() -> None:
    from accelerate.state import AcceleratorState, GradientState

    for run, (script, argv, env) in enumerate(json.loads(sys.argv[1])):
        if run:
            _start_group(run)
        module = importlib.import_module(script)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            recipe = next((v for v in vars(module).values() if type(v).__name__ == "Recipe"), None)
            if recipe is None:  # a script with its own main (the Trainer-based fine-tuning recipe)
                module.main(argv)
            else:
                module.run(recipe, argv)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


if __name__ == "__main__":
    main()
    finish()  # the run's gloo groups outlive main(): end before interpreter teardown

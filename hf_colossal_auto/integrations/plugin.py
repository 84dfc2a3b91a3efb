"""``AutoParallelPlugin``: the planner's settings for an Accelerate job, in accelerate's plugin style.

Why a plugin of our own: accelerate rejects unknown keys in its launch YAML, so the planner's settings cannot
ride in ``accelerate launch --config_file``. Like accelerate's own plugins, every field can come from the
constructor, from an environment variable (``HF_COLOSSAL_AUTO_<FIELD>``) or — ours only — from a YAML file
named by ``HF_COLOSSAL_AUTO_CONFIG``. Precedence: constructor > environment > YAML > default. An unset field
(``None``) is fully automatic: the device kind and count are detected, the memory budget is the device's memory
minus a margin, the mesh is searched.

Bad settings fail here, before any process group or model work: an unknown key (YAML or environment) or a
value of the wrong type names the key, what it got and what is allowed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..units import parse_bytes

ENV_PREFIX = "HF_COLOSSAL_AUTO_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
# Variables with our prefix that other parts of the package read; they are not plugin settings.
RESERVED_ENV = frozenset({CONFIG_ENV, ENV_PREFIX + "CACHE", ENV_PREFIX + "NO_CALIBRATE"})
DP_MODES = ("ddp", "fsdp", "hsdp", "ddp-ep", "fsdp-ep")
"""What ``plan_model(dp_modes=...)`` takes; "ddp-ep" / "fsdp-ep" (DDP / FSDP with the experts sharded over the
data-parallel axis) by name ask for it alone, "ddp" / "fsdp" include it where it is offered. Kept here (not
imported) so that reading the settings needs no torch."""
# Fields a YAML file or an environment variable cannot carry (Python objects).
PYTHON_ONLY = frozenset({"example_inputs"})


class PluginConfigError(ValueError):
    """A plugin setting is unknown or has the wrong type (names the key, its source and what is allowed)."""


def _parse_int(value: Any, key: str, source: str, minimum: int = 1) -> int:
    if isinstance(value, bool):
        raise PluginConfigError(f"{key} from {source}: expected an integer >= {minimum}, got {value!r}")
    try:
        number = int(value) if not isinstance(value, float) or value.is_integer() else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise PluginConfigError(f"{key} from {source}: expected an integer >= {minimum}, got {value!r}")
    return number


def _parse_float(value: Any, key: str, source: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = None
    if isinstance(value, bool) or number is None or not number > 0:
        raise PluginConfigError(f"{key} from {source}: expected a positive number of seconds, got {value!r}")
    return number


def _parse_bytes(value: Any, key: str, source: str) -> int:
    try:
        return parse_bytes(value)
    except (TypeError, ValueError) as exc:
        raise PluginConfigError(
            f"{key} from {source}: expected bytes per device (an integer or a string like '40GiB'), got "
            f"{value!r} ({exc})"
        ) from None


def _parse_mesh(value: Any, key: str, source: str) -> tuple[int, int]:
    """``(dp, tp)`` from a sequence or a string like ``"2x4"`` / ``"2,4"``."""
    parts: Any = value
    if isinstance(value, str):
        parts = value.lower().replace(",", "x").split("x")
    try:
        mesh = tuple(_parse_int(p, key, source) for p in parts)
    except (TypeError, PluginConfigError):
        mesh = ()
    if len(mesh) != 2:
        raise PluginConfigError(
            f"{key} from {source}: expected (dp, tp) — two positive integers such as '2x4' or [2, 4] — got {value!r}"
        )
    return mesh  # type: ignore[return-value]


def _parse_dp_modes(value: Any, key: str, source: str) -> tuple[str, ...]:
    parts = value.split(",") if isinstance(value, str) else value
    if not isinstance(parts, (list, tuple)):
        parts = None
    modes = tuple(str(p).strip().lower() for p in parts) if parts is not None else ()
    if not modes or any(m not in DP_MODES for m in modes):
        raise PluginConfigError(
            f"{key} from {source}: expected a non-empty subset of {DP_MODES} (e.g. 'ddp,fsdp'), got {value!r}"
        )
    return modes


SEARCHED_AXIS = "auto"
"""The setting of a searched mesh axis (pipeline stages, context parallelism): the planner chooses its degree."""

PIPELINE_AUTO = SEARCHED_AXIS
"""The ``pipeline`` setting that searches pipeline stages (the planner's ``pipeline=None``)."""


def _parse_degree_or_auto(value: Any, key: str, source: str, *, expected: str) -> int | str:
    """``"auto"`` or a degree (an int: 1 turns the axis off, >= 2 fixes it), the settings of the searched mesh
    axes (pipeline stages, context parallelism); ``expected`` says what is allowed, for the error."""
    if isinstance(value, str) and value.strip().lower() == SEARCHED_AXIS:
        return SEARCHED_AXIS
    try:
        return _parse_int(value, key, source)
    except PluginConfigError:
        raise PluginConfigError(f"{key} from {source}: expected {expected}, got {value!r}") from None


def _setting_from_env(name: str, parse: Any, to_setting: Any, default: int | None) -> int | None:
    """``HF_COLOSSAL_AUTO_<NAME>`` parsed and turned into what ``plan_model`` takes, ``default`` where unset."""
    key = ENV_PREFIX + name.upper()
    raw = os.environ.get(key)
    if raw is None or not raw.strip():
        return default
    return to_setting(parse(raw, name, f"environment variable {key}"))


def parse_pipeline(value: Any, key: str, source: str) -> int | str:
    """``"auto"`` (pipeline stages searched) or a pp degree: 1 plans without stages, >= 2 fixes the degree."""
    return _parse_degree_or_auto(
        value, key, source, expected="'auto' (pipeline stages searched), 1 (none) or a pp degree >= 2"
    )


def pipeline_setting(value: int | str | None) -> int | None:
    """What ``plan_model(pipeline=)`` takes for a parsed setting: None (searched) for ``"auto"``, else the
    degree."""
    return None if value == PIPELINE_AUTO else value  # type: ignore[return-value]


def pipeline_from_env(default: int | None) -> int | None:
    """``HF_COLOSSAL_AUTO_PIPELINE`` as ``plan_model(pipeline=)`` takes it, ``default`` where it is unset (for
    the entry points that read no plugin: the Trainer callback, ``autoparallelize``)."""
    return _setting_from_env("pipeline", parse_pipeline, pipeline_setting, default)


CONTEXT_PARALLEL_AUTO = SEARCHED_AXIS
"""The ``context_parallel`` setting that searches cp degrees (the planner's ``context_parallel=None``)."""


def parse_context_parallel(value: Any, key: str, source: str) -> int | str:
    """``"auto"`` (cp degrees searched) or a cp degree: 1 plans without context parallelism, >= 2 fixes it."""
    return _parse_degree_or_auto(
        value,
        key,
        source,
        expected="'auto' (cp degrees searched), 1 (none) or a cp degree >= 2 (each sequence split over that many "
        "ranks)",
    )


def context_parallel_setting(value: int | str | None) -> int | None:
    """What ``plan_model(context_parallel=)`` takes for a parsed setting: None (searched) for ``"auto"``, else
    the degree (unset: 1, no context parallelism)."""
    if value is None:
        return 1
    return None if value == CONTEXT_PARALLEL_AUTO else value  # type: ignore[return-value]


def context_parallel_from_env(default: int | None) -> int | None:
    """``HF_COLOSSAL_AUTO_CONTEXT_PARALLEL`` as ``plan_model(context_parallel=)`` takes it, ``default`` where it
    is unset (for the entry points that read no plugin: the Trainer callback, ``autoparallelize``)."""
    return _setting_from_env("context_parallel", parse_context_parallel, context_parallel_setting, default)


def stages_and_context_parallel(pipeline: int | None, context_parallel: int | None) -> tuple[int | None, int]:
    """``(pipeline, context_parallel)`` for ``plan_model``, the two settings reconciled: the runtime does not
    run pipeline stages and cp together, so a fixed degree of one turns a search (None) of the other off; both
    fixed is refused here, naming the settings; both searched is the planner's (each alone, the faster kept)."""
    fixed_pp = pipeline is not None and pipeline > 1
    fixed_cp = context_parallel is not None and context_parallel > 1
    if fixed_pp and fixed_cp:
        raise PluginConfigError(
            f"pipeline={pipeline} and context_parallel={context_parallel} are both fixed: pipeline stages and "
            "context parallelism are not run together; set one of them to 1"
        )
    if fixed_cp and pipeline is None:
        return 1, context_parallel  # type: ignore[return-value]
    if fixed_pp and context_parallel is None:
        return pipeline, 1
    return pipeline, context_parallel  # type: ignore[return-value]


def _parse_str(value: Any, key: str, source: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise PluginConfigError(f"{key} from {source}: expected a non-empty string, got {value!r}")
    return str(value)


def _parse_mapping(value: Any, key: str, source: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise PluginConfigError(
                f'{key} from {source}: expected a JSON object such as \'{{"optimizer": "sgd"}}\', got {value!r} '
                f"({exc})"
            ) from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise PluginConfigError(f"{key} from {source}: expected a mapping of plan_model keyword arguments")
    return dict(value)


_PARSERS = {
    "num_devices": _parse_int,
    "device": _parse_str,
    "memory_budget": _parse_bytes,
    "mesh_shape": _parse_mesh,
    "devices_per_node": _parse_int,
    "dp_modes": _parse_dp_modes,
    "plan_path": _parse_str,
    "save_plan_path": _parse_str,
    "time_limit_s": _parse_float,
    "timeout": _parse_float,
    "plan_kwargs": _parse_mapping,
    "pretrained": _parse_str,
    "routing": _parse_str,
    "pipeline": parse_pipeline,
    "context_parallel": parse_context_parallel,
}


@dataclass
class AutoParallelPlugin:
    """Settings for :class:`~hf_colossal_auto.integrations.AutoParallelAccelerator`.

    Every field may be given here, as ``HF_COLOSSAL_AUTO_<FIELD>`` (e.g. ``HF_COLOSSAL_AUTO_MESH_SHAPE=1x2``,
    ``HF_COLOSSAL_AUTO_MEMORY_BUDGET=40GiB``, ``HF_COLOSSAL_AUTO_PLAN_KWARGS='{"optimizer": "sgd"}'``), or in
    the YAML file named by ``HF_COLOSSAL_AUTO_CONFIG`` (keys are the field names). The constructor wins over
    the environment, which wins over the file. ``None`` means automatic.
    """

    num_devices: int | None = field(
        default=None, metadata={"help": "devices to plan for; must equal the job's processes (default: them)"}
    )
    device: str | None = field(
        default=None,
        metadata={
            "help": "device kind ('a100-80gb', 'cpu'), a `calibrate` JSON, or 'calibrate' to measure this job's "
            "machine once and cache it (default: the running device)"
        },
    )
    memory_budget: int | str | None = field(
        default=None, metadata={"help": "bytes per device or '40GiB' (default: device memory minus a margin)"}
    )
    mesh_shape: tuple[int, int] | str | None = field(
        default=None, metadata={"help": "force the (dp, tp) mesh, e.g. (2, 4) or '2x4' (default: searched)"}
    )
    devices_per_node: int | None = field(
        default=None, metadata={"help": "devices per node (default: the job's local world size)"}
    )
    dp_modes: tuple[str, ...] | str | None = field(
        default=None,
        metadata={
            "help": "data-parallel modes to try: 'ddp', 'fsdp', 'hsdp', 'ddp-ep', 'fsdp-ep' (default: all; "
            "hsdp where dp crosses nodes; ddp-ep / fsdp-ep, MoE experts sharded over dp, where dp divides "
            "the experts: 'ddp' / 'fsdp' include them)"
        },
    )
    plan_path: str | None = field(default=None, metadata={"help": "load this saved plan instead of planning"})
    save_plan_path: str | None = field(
        default=None, metadata={"help": "write the plan used here (main process)"}
    )
    example_inputs: Mapping[str, Any] | None = field(
        default=None,
        metadata={"help": "one per-process batch to plan from (default: the first batch of the data loader)"},
    )
    time_limit_s: float | None = field(default=None, metadata={"help": "ILP time limit per mesh, seconds"})
    timeout: float | None = field(
        default=None,
        metadata={
            "help": "seconds a rank waits in a collective for a peer that stopped answering before the job "
            "fails, and how long planning may take (default 300; torch's own default is 1800)"
        },
    )
    plan_kwargs: dict[str, Any] | None = field(
        default=None,
        metadata={
            "help": "further plan_model keyword arguments (e.g. a recompute switch when the planner has one)"
        },
    )
    pretrained: str | None = field(
        default=None,
        metadata={
            "help": "a HF safetensors checkpoint (directory, or a repository in the local HF cache) every rank "
            "loads its own shards from once the plan is applied; build the model on meta so that no process "
            "ever holds it whole"
        },
    )
    routing: str | None = field(
        default=None,
        metadata={
            "help": "MoE models: price expert parallelism under a measured routing load, 'measure' (counted on "
            "the planning batch by one forward of the prepared model, which needs its real weights) or the "
            "path of a histogram's JSON (RoutingLoad.save, `hf-colossal-auto plan --routing-histogram`); unset: "
            "routing uniform over experts"
        },
    )

    pipeline: int | str | None = field(
        default=None,
        metadata={
            "help": "pipeline stages: 'auto' (the default: searched with the rest, chosen where the cost model "
            "says they are faster), 1 (plans without stages) or a pp degree >= 2 (only pipeline plans)"
        },
    )

    context_parallel: int | str | None = field(
        default=None,
        metadata={
            "help": "context parallelism (each sequence split over cp ranks of a replica, which read the same "
            "rows): 1 (the default: none), a cp degree >= 2 (only plans with it; the sequence length must be a "
            "multiple of 2 x cp) or 'auto' (searched: every cp degree that divides the devices and the sequence, "
            "kept where the cost model predicts a faster step or nothing fits without it). Off by default "
            "because it pays only at long sequences and runs decoder-only causal LMs alone"
        },
    )

    def __post_init__(self) -> None:
        names = [f.name for f in fields(self)]
        yaml_values = _load_yaml_settings(names)
        env_values = _env_settings(names)
        for name in names:
            value = getattr(self, name)
            source = "the constructor"
            if value is None and name in env_values:
                value, source = env_values[name], f"environment variable {ENV_PREFIX}{name.upper()}"
            elif value is None and name in yaml_values:
                value, source = yaml_values[name], f"{os.environ[CONFIG_ENV]} (via {CONFIG_ENV})"
            if value is not None and name in _PARSERS:
                value = _PARSERS[name](value, name, source)
            setattr(self, name, value)
        if self.example_inputs is not None and not isinstance(self.example_inputs, Mapping):
            raise PluginConfigError(
                "example_inputs: expected a mapping of model.forward keyword arguments (one per-process batch), "
                f"got {type(self.example_inputs).__name__}"
            )
        if self.routing is not None and self.routing != "measure" and not Path(self.routing).is_file():
            raise PluginConfigError(
                f"routing: {self.routing!r} is neither 'measure' nor a file; give 'measure' or the path of a "
                "routing histogram's JSON (RoutingLoad.save)"
            )
        if self.plan_path is not None and self.mesh_shape is not None:
            raise PluginConfigError(
                "plan_path and mesh_shape are both set: a saved plan already fixes its mesh; drop one of them"
            )
        if isinstance(self.pipeline, int) and self.pipeline > 1 and self.mesh_shape is not None:
            raise PluginConfigError(
                f"pipeline={self.pipeline} and mesh_shape={self.mesh_shape} are both set: a pipeline lays out its "
                "(pp, dp, tp) mesh itself; drop mesh_shape, or set pipeline=1 to plan on that mesh"
            )
        if self.context_parallel is not None:
            stages_and_context_parallel(
                pipeline_setting(self.pipeline), context_parallel_setting(self.context_parallel)
            )

    def planner_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``plan_model`` from the fields that are set (the accelerator adds the rest)."""
        out: dict[str, Any] = {}
        for name in ("num_devices", "device", "memory_budget", "mesh_shape", "devices_per_node", "dp_modes"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.time_limit_s is not None:
            out["time_limit_s"] = self.time_limit_s
        if self.routing is not None:
            out["routing"] = self.routing
        if self.pipeline is not None:
            out["pipeline"] = pipeline_setting(self.pipeline)
        if self.context_parallel is not None:
            out["context_parallel"] = context_parallel_setting(self.context_parallel)
        out.update(self.plan_kwargs or {})
        return out


def _allowed(names: list[str]) -> str:
    return ", ".join(n for n in names if n not in PYTHON_ONLY)


def _env_settings(names: list[str]) -> dict[str, str]:
    """``HF_COLOSSAL_AUTO_<FIELD>`` values; any other variable with our prefix is a typo and an error."""
    out = {}
    for key, value in os.environ.items():
        if not key.startswith(ENV_PREFIX) or key in RESERVED_ENV:
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name not in names or name in PYTHON_ONLY:
            raise PluginConfigError(
                f"unknown setting {key}: AutoParallelPlugin reads {ENV_PREFIX}<FIELD> for FIELD in "
                f"{_allowed(names).upper()} (and {', '.join(sorted(RESERVED_ENV))} are read elsewhere); "
                "unset it or fix the name"
            )
        out[name] = value
    return out


def _load_yaml_settings(names: list[str]) -> dict[str, Any]:
    """The YAML file named by ``HF_COLOSSAL_AUTO_CONFIG``: a mapping of field names, or a combined file whose
    ``auto_parallel:`` section holds them (see ``hf-colossal-auto launch``)."""
    path = os.environ.get(CONFIG_ENV)
    if not path:
        return {}
    if not Path(path).is_file():
        raise PluginConfigError(f"{CONFIG_ENV}={path}: no such file")
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if (
        isinstance(data, Mapping) and "auto_parallel" in data
    ):  # a combined file: accelerate keys + our section
        data = data["auto_parallel"] or {}
    if not isinstance(data, Mapping):
        raise PluginConfigError(
            f"{path} (via {CONFIG_ENV}): expected a mapping of settings, got {type(data).__name__}"
        )
    unknown = sorted(str(k) for k in data if k not in names or k in PYTHON_ONLY)
    if unknown:
        raise PluginConfigError(
            f"{path} (via {CONFIG_ENV}): unknown setting(s) {unknown}; allowed: {_allowed(names)}"
        )
    return dict(data)

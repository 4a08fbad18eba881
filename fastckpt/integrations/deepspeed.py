"""A drop-in for `deepspeed.checkpointing`: `import fastckpt.integrations.deepspeed as ckpt`.

`configure` takes DeepSpeed's arguments and `activation_checkpointing` config section (parsed here, so
DeepSpeed need not be installed) plus `policy=`; `checkpoint` runs `fastckpt.checkpoint` with them:

- default: recompute, non-reentrant; gradients equal DeepSpeed's reentrant CheckpointFunction's.
- `checkpoint_in_cpu`: the segment's saved inputs are offloaded (the policy gains `+offload`).
- `partition_activations`: each floating-point saved input keeps 1/mp of its elements on this rank and is
  all-gathered over the model-parallel group in backward (saved-tensor hooks around the checkpoint).
- `contiguous_checkpointing` / `num_checkpoints`: validated as DeepSpeed does, otherwise no effect: the
  caching allocator already reuses the freed blocks, fastckpt needs no preallocated buffers.
- `synchronize`: device synchronize at the start and end of the forward and of each recompute.
- `profile`: forward and recompute wall times per call, in `fastckpt.track()`'s records.

DeepSpeed's model-parallel RNG tracker (`get_cuda_rng_tracker`) is saved at forward and replayed for the
recompute, as DeepSpeed does, so dropout inside `tracker.fork()` draws the same masks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fastckpt.engine.options import CheckpointOptions
from fastckpt.engine.strategy import Strategy
from fastckpt.policies import Policy, resolve
from fastckpt.storage.accounting import SegmentRecord, register
from fastckpt.storage.packer import SegmentStorage

__all__ = [
    "ContiguousCheckpointingError",
    "Settings",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
    "settings",
]

_DS_CHECKPOINTING = "deepspeed.runtime.activation_checkpointing.checkpointing"

# The `activation_checkpointing` section of a DeepSpeed config: key -> configure() argument.
CONFIG_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `configure` set; `checkpoint` reads it on every call."""

    configured: bool = False
    mpu: Any = None
    mp_rank: int = 0
    mp_size: int = 1
    mp_group: Any = None  # None: the default group (only used when mp_size > 1)
    partition_activations: bool = False
    contiguous_checkpointing: bool = False  # accepted for compatibility; no effect on layout
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False
    policy: Policy | None = None  # None: fastckpt's current default policy ("recompute" unless set otherwise)
    use_reentrant: bool = False


_settings = Settings()


class ContiguousCheckpointingError(ValueError, AssertionError):
    """contiguous_checkpointing without what DeepSpeed requires with it (partition_activations, num_checkpoints).

    DeepSpeed's configure asserts these, so code written against it catches AssertionError; code written
    against fastckpt catches ValueError. Both catch this, and DeepSpeed need not be installed.
    """


def settings() -> Settings:
    """The current settings (read-only)."""
    return _settings


def is_configured() -> bool:
    """True once `configure` has been called (and not undone by `reset(configuration=True)`)."""
    return _settings.configured


def configure(
    mpu_: Any,
    deepspeed_config: dict | str | os.PathLike | None = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
    *,
    policy: str | Policy | None = None,
    use_reentrant: bool = False,
) -> None:
    """Set the checkpoint settings: defaults, then `deepspeed_config`'s section, then explicit arguments."""
    values: dict[str, Any] = {}
    if deepspeed_config is not None:
        values.update(_read_config(deepspeed_config))
    explicit = dict(
        partition_activations=partition_activations,
        contiguous_checkpointing=contiguous_checkpointing,
        num_checkpoints=num_checkpoints,
        checkpoint_in_cpu=checkpoint_in_cpu,
        synchronize=synchronize,
        profile=profile,
    )
    values.update({name: value for name, value in explicit.items() if value is not None})
    for name, value in values.items():
        _check_type(name, value)
    if values.get("contiguous_checkpointing"):
        if not values.get("partition_activations"):
            raise ContiguousCheckpointingError(
                "fastckpt.integrations.deepspeed.configure: contiguous_checkpointing (contiguous_memory_optimization) "
                "requires partition_activations=True, as in DeepSpeed; enable partitioning or drop "
                "contiguous_checkpointing"
            )
        if values.get("num_checkpoints") is None:
            raise ContiguousCheckpointingError(
                "fastckpt.integrations.deepspeed.configure: contiguous_checkpointing requires num_checkpoints "
                "(number_checkpoints), as in DeepSpeed; pass the number of checkpointed layers"
            )
    parsed = None if policy is None else Policy.parse(policy)
    if parsed is not None and values.get("partition_activations"):
        _check_partition_policy(parsed)
    if not isinstance(use_reentrant, bool):
        raise TypeError(
            f"fastckpt.integrations.deepspeed.configure: `use_reentrant` must be a bool, got {type(use_reentrant)}"
        )
    global _settings
    _settings = Settings(configured=True, **_model_parallel(mpu_), policy=parsed, use_reentrant=use_reentrant, **values)


def _read_config(config: dict | str | os.PathLike) -> dict[str, Any]:
    """The `activation_checkpointing` section of a DeepSpeed config (dict or JSON path) as configure() arguments."""
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                config = json.load(f, object_pairs_hook=_no_duplicate_keys)
        except OSError as error:
            raise ValueError(
                f"fastckpt.integrations.deepspeed.configure: cannot read deepspeed_config file {str(config)!r}: {error}"
            ) from error
    if not isinstance(config, dict):
        raise TypeError(
            "fastckpt.integrations.deepspeed.configure: `deepspeed_config` must be a dict or the path of a JSON file, "
            f"got {type(config)}"
        )
    section = config.get("activation_checkpointing", {})
    if not isinstance(section, dict):
        raise TypeError(
            "fastckpt.integrations.deepspeed.configure: deepspeed_config['activation_checkpointing'] must be a dict, "
            f"got {type(section)}"
        )
    unknown = [key for key in section if key not in CONFIG_KEYS]
    if unknown:
        raise ValueError(
            f"fastckpt.integrations.deepspeed.configure: unknown key {unknown[0]!r} in "
            f"deepspeed_config['activation_checkpointing']; valid keys are {sorted(CONFIG_KEYS)}"
        )
    return {CONFIG_KEYS[key]: value for key, value in section.items()}


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object hook: a repeated key is an error, as DeepSpeed's own parser makes it."""
    keys = [key for key, _ in pairs]
    repeated = sorted({key for key in keys if keys.count(key) > 1})
    if repeated:
        raise ValueError(f"fastckpt.integrations.deepspeed.configure: deepspeed_config repeats the key(s) {repeated}")
    return dict(pairs)


def _check_type(name: str, value: Any) -> None:
    """Settings are bools except num_checkpoints (a positive int or None): reject anything else by name."""
    if name == "num_checkpoints":
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(
                "fastckpt.integrations.deepspeed.configure: num_checkpoints (number_checkpoints) must be a positive "
                f"int, got {value!r}"
            )
    elif not isinstance(value, bool):
        raise TypeError(
            f"fastckpt.integrations.deepspeed.configure: {name} must be a bool (true/false in JSON), got {value!r}"
        )


def _model_parallel(mpu: Any) -> dict[str, Any]:
    """Rank, size and group of the model-parallel unit; the tensor-parallel methods win, as in DeepSpeed."""
    if mpu is None:
        return {}
    for prefix in ("get_tensor_model_parallel_", "get_model_parallel_"):
        methods = [getattr(mpu, prefix + what, None) for what in ("rank", "world_size", "group")]
        if all(callable(m) for m in methods):
            rank, size, group = (m() for m in methods)
            break
    else:
        raise TypeError(
            f"fastckpt.integrations.deepspeed.configure: `mpu_` ({type(mpu).__name__}) must provide "
            "get_model_parallel_rank/world_size/group (or the get_tensor_model_parallel_* variants); pass None "
            "without model parallelism"
        )
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
        raise ValueError(
            f"fastckpt.integrations.deepspeed.configure: `mpu_` gave model-parallel rank {rank!r} of world size "
            f"{size!r}"
        )
    return dict(mpu=mpu, mp_rank=rank, mp_size=size, mp_group=group)


def _check_partition_policy(policy: Policy) -> None:
    """Partitioning shards the inputs a recompute keeps; a storage policy keeps every activation instead."""
    if not policy.recompute:
        raise ValueError(
            "fastckpt.integrations.deepspeed.configure: partition_activations=True shards the segment inputs that a "
            f"recompute policy keeps, but policy={str(policy)!r} stores every activation (no recompute); use a policy "
            "with 'recompute' (e.g. 'recompute+int8') or partition_activations=False"
        )


def set_num_layers(nlayers: int | None) -> None:
    """Set num_checkpoints (DeepSpeed sizes its contiguous buffers with it; fastckpt only records it)."""
    _check_type("num_checkpoints", nlayers)
    global _settings
    _settings = dataclasses.replace(_settings, num_checkpoints=nlayers)


def reset(*, configuration: bool = False) -> None:
    """Drop state kept between forward and backward (fastckpt keeps none); configuration=True also unconfigures.

    DeepSpeed's reset frees contiguous buffers and drains its offload engine after forwards without a
    backward (evaluation). Here every saved input lives in its autograd graph and goes with it, so there
    is nothing to drain; the settings stay, as DeepSpeed's do (Megatron calls reset() in evaluation).
    """
    global _settings
    if configuration:
        _settings = Settings()


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Checkpoint `function(*args, **kwargs)` with the configured settings; returns what DeepSpeed's returns."""
    return _checkpoint(function, args, kwargs, _settings.use_reentrant)


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`checkpoint`, always non-reentrant (DeepSpeed's non_reentrant_checkpoint)."""
    return _checkpoint(function, args, kwargs, False)


# Under torch.compile the call runs eagerly, as fastckpt.checkpoint does (DeepSpeed disables compile here too).
@torch.compiler.disable
def _checkpoint(function: Callable[..., Any], args: tuple, kwargs: dict, use_reentrant: bool) -> Any:
    """One checkpointed call: pick the storage around fastckpt.checkpoint, time and synchronize it."""
    if not callable(function):
        raise TypeError(
            "fastckpt.integrations.deepspeed.checkpoint: `function` must be callable (a module or function), got "
            f"{type(function)}"
        )
    config = _settings
    policy = resolve(config.policy)
    if config.checkpoint_in_cpu:
        policy = dataclasses.replace(policy, offload=True)
    if config.partition_activations:
        _check_partition_policy(policy)  # a default set by `with fastckpt.policy(...)` is only known now
    strategy = Strategy(policy)
    # One storage and one record per call: the policy's storage keeps the inputs (or, without recompute,
    # every activation); partitioning is a storage around it; a record exists when something is stored,
    # partitioned or profiled.
    storage = strategy.storage()
    if config.partition_activations and config.mp_size > 1:
        storage = _PartitionedStorage(config, storage or SegmentStorage(policy))
    record = storage.record if storage is not None else None
    if record is None and config.profile:
        record = SegmentRecord(policy=str(policy))
        register(record)
    segment = _Segment(function, config.synchronize or config.profile, record if config.profile else None)

    tensors = _tensors(args, kwargs)
    if segment.synchronize:
        _synchronize(tensors)
    start = time.perf_counter()
    function_with_kwargs = segment
    if strategy.recompute and use_reentrant and kwargs:  # the reentrant engine takes positional inputs only
        function_with_kwargs = _positional(segment, len(args), tuple(kwargs))
        args, kwargs = args + tuple(kwargs.values()), {}
    # The engines save the segment inputs under `storage`'s hooks and add none for plain "recompute": so a
    # partition sees exactly the inputs (tests/integrations checks this).
    outputs = strategy.run(
        function_with_kwargs, args, kwargs, CheckpointOptions(use_reentrant=use_reentrant), storage=storage
    )
    segment.forward_done = True
    if segment.synchronize:
        _synchronize(tensors)
    if segment.record is not None:
        segment.record.forward_seconds += time.perf_counter() - start
    return _as_deepspeed_returns(outputs)


class _Segment:
    """The function as the engine calls it: forward once, then recomputes with the RNG tracker replayed."""

    def __init__(self, function: Callable[..., Any], synchronize: bool, record: SegmentRecord | None) -> None:
        self.function = function
        self.synchronize = synchronize
        self.record = record
        self.forward_done = False
        self.tracker = _rng_tracker()
        # DeepSpeed's CheckpointFunction saves the tracker's states before the forward, as fastckpt saves the
        # global RNG: get_states() copies the dict, and fork() replaces (never mutates) a state tensor.
        self.tracker_states = self.tracker.get_states() if self.tracker is not None else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The first call is the forward; later ones are recomputes."""
        if not self.forward_done:
            return self.function(*args, **kwargs)
        return self.recompute(*args, **kwargs)

    def recompute(self, *args: Any, **kwargs: Any) -> Any:
        """Re-run the function for backward under the forward's tracker states; restore the caller's after."""
        tensors = _tensors(args, kwargs)
        if self.synchronize:
            _synchronize(tensors)
        start = time.perf_counter()
        current = None
        if self.tracker is not None:
            current = self.tracker.get_states()
            # A copy: fork() writes into the dict it is given, and a second backward must start over.
            self.tracker.set_states(copy.copy(self.tracker_states))
        try:
            return self.function(*args, **kwargs)
        finally:  # also when the engine stops the recompute early (it raises through here)
            if self.tracker is not None:
                self.tracker.set_states(current)
            if self.synchronize:
                _synchronize(tensors)
            if self.record is not None:
                self.record.recompute_seconds += time.perf_counter() - start
                register(self.record)  # a track() block around the backward only sees it here


def _positional(function: Callable[..., Any], count: int, names: tuple[str, ...]) -> Callable[..., Any]:
    """`function` taking its keyword arguments as trailing positional ones (DeepSpeed's kwargs handling)."""

    def call(*inputs: Any) -> Any:
        return function(*inputs[:count], **dict(zip(names, inputs[count:], strict=True)))

    return call


class _Shard:
    """This rank's slice of a partitioned input (padded to equal length), as the storage keeps it."""

    __slots__ = ("packed", "shape", "numel")

    def __init__(self, packed: Any, shape: torch.Size, numel: int) -> None:
        self.packed = packed
        self.shape = shape
        self.numel = numel


class _PartitionedStorage:
    """A storage that keeps 1/mp of each floating-point segment input (through the policy's storage) and
    all-gathers it over the model-parallel group in backward; other tensors go to the policy's storage as
    they are. Its record is the policy storage's, named for the partition."""

    def __init__(self, config: Settings, storage: SegmentStorage) -> None:
        self.rank, self.size, self.group = config.mp_rank, config.mp_size, config.mp_group
        self.storage = storage
        self.record = storage.record
        self.record.policy = f"{storage.policy} (1/{self.size} kept)"

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The saved-tensor-hooks context the segment's inputs are saved under."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        """Keep this rank's slice of `t`; a tensor that is not partitioned, as the policy's storage keeps it."""
        if not self._partitioned(t):
            return self.storage.pack(t)
        flat = t.detach().reshape(-1)
        length = -(-flat.numel() // self.size)  # ceil: the last rank's slice is zero-padded
        begin, end = min(self.rank * length, flat.numel()), min((self.rank + 1) * length, flat.numel())
        shard = flat.new_zeros(length)  # a copy: a view would keep the whole tensor alive
        shard[: end - begin].copy_(flat[begin:end])
        raw_before = self.record.raw_bytes
        packed = self.storage.pack(shard)
        # Raw bytes are the whole tensor's (what plain autograd would keep); kept bytes, the shard's. The
        # storage counts no bytes for a shard it keeps as it is (too small for it): counted here then.
        if self.record.raw_bytes == raw_before:
            self.record.count_raw(shard)
            self.record.count_kept((shard,))
        self.record.count_raw(t, elements=t.numel() - shard.numel())
        return _Shard(packed, t.shape, t.numel())

    def _partitioned(self, t: torch.Tensor) -> bool:
        """DeepSpeed's rule (floating point, at least one element per rank, not marked no_checkpointing), less
        leaves that require grad: parameters and such stay alive anyway, a shard of them would save nothing."""
        if not t.is_floating_point() or t.numel() < self.size or getattr(t, "no_checkpointing", False):
            return False
        base = t._base if t._base is not None else t
        return not (base.is_leaf and base.requires_grad)

    def unpack(self, packed: Any) -> torch.Tensor:
        """The whole tensor again: every rank's slice, all-gathered over the model-parallel group."""
        if not isinstance(packed, _Shard):
            return self.storage.unpack(packed)
        shard = self.storage.unpack(packed.packed)
        full = shard.new_empty(shard.numel() * self.size)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.14
        gather(full, shard, group=self.group)
        return full[: packed.numel].view(packed.shape)


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The top-level tensor arguments (their devices decide what to synchronize)."""
    return [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]


def _synchronize(tensors: list[torch.Tensor]) -> None:
    """torch.cuda.synchronize on each CUDA device among `tensors`; CPU work is already synchronous."""
    for device in {t.device for t in tensors if t.device.type == "cuda"}:
        torch.cuda.synchronize(device)


def _as_deepspeed_returns(outputs: Any) -> Any:
    """DeepSpeed returns a lone output unwrapped and several as a tuple (lists too)."""
    if isinstance(outputs, (tuple, list)):
        return outputs[0] if len(outputs) == 1 else tuple(outputs)
    return outputs


def _rng_tracker() -> Any:
    """DeepSpeed's RNG tracker if DeepSpeed's checkpointing module is loaded (no tracker states exist otherwise)."""
    module = sys.modules.get(_DS_CHECKPOINTING)
    return module.get_cuda_rng_tracker() if module is not None else None


def _deepspeed_checkpointing(what: str) -> Any:
    """DeepSpeed's checkpointing module, imported now; a clear ImportError when DeepSpeed is missing."""
    try:
        return importlib.import_module(_DS_CHECKPOINTING)
    except ImportError as error:
        raise ImportError(
            f"fastckpt.integrations.deepspeed.{what} is DeepSpeed's and needs it installed (pip install deepspeed); "
            "configure() and checkpoint() work without it"
        ) from error


def get_cuda_rng_tracker() -> Any:
    """DeepSpeed's model-parallel RNG tracker (the one `checkpoint` replays for recomputes)."""
    return _deepspeed_checkpointing("get_cuda_rng_tracker").get_cuda_rng_tracker()


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """DeepSpeed's model_parallel_cuda_manual_seed, with the model-parallel unit given to our `configure`."""
    module = _deepspeed_checkpointing("model_parallel_cuda_manual_seed")
    mpu = _settings.mpu if _settings.mpu is not None else module.mpu
    if mpu is None:
        raise RuntimeError(
            "fastckpt.integrations.deepspeed.model_parallel_cuda_manual_seed needs the model-parallel unit: call "
            "configure(mpu_) first (without model parallelism, torch.manual_seed is all you need)"
        )
    with _deepspeed_mpu(module, mpu):
        module.model_parallel_cuda_manual_seed(seed)


@contextlib.contextmanager
def _deepspeed_mpu(module: Any, mpu: Any) -> Iterator[None]:
    """DeepSpeed's function reads its own module's `mpu`: lend it ours for the call only."""
    previous = module.mpu
    module.mpu = mpu
    try:
        yield
    finally:
        module.mpu = previous

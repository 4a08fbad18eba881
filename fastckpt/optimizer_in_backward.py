"""`fastckpt.optimizer_in_backward`: each parameter's optimizer step taken as soon as its gradient is complete,
during the backward, and the gradient freed at once.

A full fine-tune's backward ends with every parameter's gradient alive (as many bytes as the weights), and the
optimizer's `foreach` step adds temporaries of that size again; activation checkpointing reaches neither. With
the step in the backward (a post-accumulate-grad hook per parameter) one parameter's gradient exists at a time,
beside the weights, the optimizer's state and the activations.

    optimizer = fastckpt.optimizer_in_backward(torch.optim.AdamW(model.parameters()), max_grad_norm=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, ...)   # drives the wrapped optimizer's groups
    for batch in loader:
        optimizer.backward(model(**batch).loss)   # the norm pass, then the step pass (loss.backward() without clipping)
        optimizer.step()                          # steps what the backward left (nothing, in the usual case)
        scheduler.step()
        optimizer.zero_grad()

What the plain loop does between the backward and its step is kept, not silently dropped:

- clipping by the global norm (`max_grad_norm`, as `torch.nn.utils.clip_grad_norm_`) needs every gradient's norm
  before the first step: `backward(loss)` runs the backward twice through the same graph, first computing the
  norms (each gradient freed as it is measured), then stepping with the clipped gradients (the cost: one more
  backward, with its recomputation). A trained parameter left out of the wrapped optimizer receives its gradient
  in both passes (twice; restricting the first pass with `inputs=` would prune reentrant checkpoints' insides).
  A plain `loss.backward()` with clipping keeps the gradients and `step()` clips and steps them (correct, no
  memory saved; a warning says so once).
- gradient accumulation (`accumulation_steps=N`): a parameter is stepped in the backward that brings its Nth
  gradient since the last `step()`; the earlier ones accumulate as usual (the memory of the gradients is then
  kept between micro-steps, as in the plain loop). `step()` steps any gradient left (a shorter last
  accumulation), clipped over all of them when clipping.
- fp16 loss scaling (`torch.amp.GradScaler`) is refused: the parameters would be stepped with scaled gradients
  before the scaler could look for an overflow. bf16 needs no scaler.
- several ranks (DDP, FSDP2, DeepSpeed) are refused: their gradient is reduced across ranks after the hook fires.
- a parameter whose gradient arrives in two parts within one backward (used by two reentrant checkpoints) is
  refused when the second part arrives.

The wrapped optimizer is stepped one parameter at a time (its `param_groups` narrowed to that parameter's
group holding it alone), so its state, `state_dict()` and `load_state_dict()` are the plain optimizer's; any
`torch.optim.Optimizer` built from parameter groups works (not LBFGS, whose step needs the loss again).
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fastckpt.heads import backward_repeated

_NAME = "fastckpt.optimizer_in_backward"

# A parameter over twice this many bytes is stepped in slices of about this size: an elementwise optimizer's step
# makes temporaries the size of what it steps (AdamW's `foreach` denominator, bitsandbytes' fp32 copies of its
# 8-bit state on CPU), and stepped whole the largest parameter (an embedding: 1 GiB in Llama-3.2-1B) would set the
# iteration's peak.
SLICE_BYTES = 64 << 20
_ALIGN = 4096  # slice boundaries, in elements: whole bitsandbytes blocks and whole vector lanes
_BLOCK = 256  # bitsandbytes' blockwise 8-bit state: one scale (absmax) per 256 elements, on CPU and CUDA

# Optimizers whose update of an element reads only that element's gradient and state and its group's settings:
# stepping such a parameter slice by slice is stepping it whole.
_ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad,
)  # fmt: skip
_ELEMENTWISE_BITSANDBYTES = re.compile(r"(Paged)?(Adam|AdamW|Lion)(8bit|32bit)?")


class OptimizerInBackward(torch.optim.Optimizer):
    """A torch optimizer stepped from the backward, one parameter at a time (the module docstring); a
    `torch.optim.Optimizer` itself, so LR schedulers, accelerate and Trainer take it. `param_groups`, `state` and
    `defaults` are the wrapped optimizer's. `grad_norm`: the last step's total gradient norm before clipping
    (with `max_grad_norm`), as `clip_grad_norm_` returns it."""

    # GradScaler.step hands such an optimizer its scale (`grad_scale`, `found_inf`) instead of unscaling and checking
    # gradients that no longer exist: step() sees it and refuses.
    _step_supports_amp_scaling = True

    def __init__(
        self, optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None, accumulation_steps: int = 1
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called: the groups and the state are the wrapped optimizer's.
        _check(optimizer, max_grad_norm, accumulation_steps)
        self.optimizer = optimizer
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.accumulation_steps = accumulation_steps
        self.grad_norm: torch.Tensor | None = None
        self._arrivals: dict[torch.Tensor, int] = {}  # gradients accumulated per parameter since the last step()
        self._stepped: set[torch.Tensor] = set()  # parameters stepped since the last step()
        self._measured: dict[torch.Tensor, torch.Tensor] = {}  # norms of this iteration's stepped gradients
        self._norm_pass = False  # the first of backward()'s two passes runs: gradients measured, then freed
        self._clip: torch.Tensor | None = None  # the step pass's clipping coefficient
        # a loss head hands out its parameters' gradients (computed in the forward) once, in the norm pass
        # (fastckpt.heads.backward_repeated): held here for the step, after the step pass
        self._handed_out: set[torch.Tensor] = set()
        self._held: dict[torch.Tensor, torch.Tensor] = {}
        self._clipped = False  # the held gradients were clipped by clip_grad_norm_ in this iteration
        self._warned_kept = False
        self._groups: tuple[int, int] | None = None  # (id, length) of the param_groups list the index was built on
        self._index: dict[torch.Tensor, tuple[int, int]] = {}  # parameter -> (its group's index, its index there)
        self._handles = self._hooked(self._parameters())

    # The wrapped optimizer's groups, state and defaults (its load_state_dict replaces the objects: read them live).
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def __getattr__(self, name: str) -> Any:
        # Anything else the wrapped optimizer has (a schedule-free optimizer's train()/eval(), ...).
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return (
            f"OptimizerInBackward({self.optimizer!r}, max_grad_norm={self.max_grad_norm}, "
            f"accumulation_steps={self.accumulation_steps})"
        )

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward(**kwargs)`, stepping each parameter as its gradient completes. With `max_grad_norm` and
        no gradients held from earlier micro-steps, a first backward through the same graph computes the norm
        (its gradients freed as they are measured), then the second steps with the clipped gradients."""
        if self.max_grad_norm is None or self.accumulation_steps > 1 or self._pending():  # gradients held: no norm pass
            loss.backward(**kwargs)
            return
        self._norm_pass = True
        try:
            with backward_repeated() as self._handed_out:
                loss.backward(**{**kwargs, "retain_graph": True})
        finally:
            self._norm_pass = False
        normed = dict(self._measured)
        self._clip = _clip_coefficient(self.max_grad_norm, self._total(normed))
        try:
            loss.backward(**kwargs)
            for p in list(self._held):  # gradients the loss head handed out once, in the norm pass
                p.grad = self._held.pop(p).mul_(self._clip)
                self._step_parameter(p)
        finally:
            self._clip, self._handed_out = None, set()
            self._held.clear()
        if any(p not in self._stepped for p in normed) or any(p not in normed for p in self._stepped):
            raise RuntimeError(
                f"{_NAME}: the norm pass and the step pass reached different parameters ({len(normed)} and "
                f"{len(self._stepped)}): the backward is not repeatable (a hook or a graph that changes between "
                "two backwards); clip with step() instead: loss.backward(), then optimizer.step()"
            )

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Step the parameters whose gradients the backward left (a shorter accumulation, clipping without
        `backward()`), clipped over all of them with `max_grad_norm`; then a new iteration begins."""
        if closure is not None:
            raise ValueError(f"{_NAME}: step() takes no closure: the parameters are stepped during the backward")
        if self.__dict__.get("grad_scale") is not None or self.__dict__.get("found_inf") is not None:
            raise RuntimeError(
                f"{_NAME}: fp16 loss scaling (torch.amp.GradScaler) is not supported: the parameters were stepped "
                "during the backward with scaled gradients, before the scaler could look for an overflow; train "
                "in bf16 (no scaler), or use the plain optimizer"
            )
        pending = self._pending()
        if pending and self.max_grad_norm is not None and not self._clipped:
            self.clip_grad_norm_(self.max_grad_norm)
        elif pending or self._measured:
            self.grad_norm = self._iteration_norm(pending)
        for p in pending:
            self._step_parameter(p)
        self._new_iteration()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over this iteration's gradients, those stepped in the backward (measured
        then) and those still held (clipped here): the total norm before clipping. Trainer's clipping lands here
        (`hf.enable(optimizer_in_backward=True)`), since after a step in the backward `.grad` is None."""
        if float(norm_type) != 2.0:
            raise ValueError(f"{_NAME}: clip_grad_norm_ computes the L2 norm (norm_type=2), got {norm_type!r}")
        held = self._pending()
        self.grad_norm = total = self._iteration_norm(held)
        if not math.isfinite(max_norm):
            return total
        if self._stepped and self.max_grad_norm is None and bool(total > max_norm):
            raise RuntimeError(
                f"{_NAME}: clipping at {max_norm} was asked for after parameters were stepped unclipped in the "
                f"backward (total norm {float(total):.4g}); pass max_grad_norm={max_norm} to {_NAME}"
            )
        if held:
            torch._foreach_mul_([p.grad for p in held], _clip_coefficient(max_norm, total))
            self._clipped = True
        return total

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad; a new iteration begins (gradients held are discarded)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self._new_iteration()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
        self._groups = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._handles += self._hooked(param_group["params"])

    def remove(self) -> None:
        """Take the hooks off: the wrapped optimizer steps as a plain one again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hooked(self, parameters: Iterable[torch.Tensor]) -> list[Any]:
        """Hook each trained parameter (a frozen one handed to the optimizer gets no gradient: a parameter unfrozen
        later is stepped by step(), its gradient kept until then, as in the plain loop)."""
        return [p.register_post_accumulate_grad_hook(self._on_gradient) for p in parameters if p.requires_grad]

    def _parameters(self) -> Iterable[torch.Tensor]:
        return (p for group in self.optimizer.param_groups for p in group["params"])

    def _pending(self) -> list[torch.Tensor]:
        """The parameters holding a gradient not yet stepped in this iteration."""
        return [p for p in self._parameters() if p.grad is not None and p not in self._stepped]

    def _iteration_norm(self, held: list[torch.Tensor]) -> torch.Tensor:
        """The total norm of this iteration's gradients: those stepped in the backward (measured then) and `held`."""
        return self._total({**self._measured, **{p: torch.linalg.vector_norm(p.grad) for p in held}})

    def _total(self, norms: dict[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The total norm of per-parameter norms, combined in the parameters' order (as clip_grad_norm_ would)."""
        return _total_norm([norms[p] for p in self._parameters() if p in norms])

    def _new_iteration(self) -> None:
        self._arrivals.clear()
        self._stepped.clear()
        self._measured = {}
        self._clipped = False

    @torch.no_grad()
    def _on_gradient(self, p: torch.Tensor) -> None:
        if self._norm_pass:  # measured, then freed (or held for the step, where the step pass brings it no more)
            self._measured[p] = torch.linalg.vector_norm(p.grad)
            if p in self._handed_out:
                self._held[p] = p.grad
            p.grad = None
            return
        if p in self._held:  # its whole gradient is held from the norm pass: what arrives now is a part of it again
            p.grad = None  # (a tied embedding's lookup; the loss head's own part is not handed out twice)
            return
        if p in self._stepped:
            raise RuntimeError(
                f"{_NAME}: a parameter of shape {tuple(p.shape)} received a gradient after it was stepped in this "
                "iteration: either its gradient arrives in parts within one backward (a parameter used by two "
                "reentrant checkpoints: use use_reentrant=False) or a second backward ran before optimizer.step() "
                f"(gradient accumulation: pass accumulation_steps=N to {_NAME})"
            )
        self._arrivals[p] = arrivals = self._arrivals.get(p, 0) + 1
        if arrivals < self.accumulation_steps:
            return  # accumulated, as in the plain loop
        if self.max_grad_norm is not None:
            if self._clip is None:  # the norm is not known: kept for step(), which clips and steps
                self._warn_kept()
                return
            p.grad.mul_(self._clip)
        else:
            self._measured[p] = torch.linalg.vector_norm(p.grad)  # for clip_grad_norm_ and grad_norm
        self._step_parameter(p)

    def _step_parameter(self, p: torch.Tensor) -> None:
        """The wrapped optimizer's step for `p` alone, in slices where it is large (`_Slices`), then its gradient
        freed."""
        slices = _Slices.of(self.optimizer, p)
        if slices is None:
            self._step_alone(p, p)
        else:
            slices.step(lambda piece: self._step_alone(p, piece))
        p.grad = None
        self._stepped.add(p)

    def _step_alone(self, p: torch.Tensor, stepped: torch.Tensor) -> None:
        """Step `stepped` (`p`, or a slice of it holding its own gradient and state) with `p`'s group's settings.
        A torch optimizer steps with its groups narrowed to that group holding `stepped` alone; bitsandbytes' are
        stepped through their per-parameter methods with `p`'s own group and index, which key their per-parameter
        settings (Trainer keeps the embeddings' state in 32 bits that way)."""
        optimizer, group = self.optimizer, self._group(p)
        if _is_bitsandbytes(optimizer):
            _bitsandbytes_step(optimizer, stepped, *self._index[p])
            return
        groups, params = optimizer.param_groups, group["params"]
        group["params"], optimizer.param_groups = [stepped], [group]
        try:
            optimizer.step()
        finally:
            group["params"], optimizer.param_groups = params, groups

    def _group(self, p: torch.Tensor) -> dict[str, Any]:
        groups = self.optimizer.param_groups
        if self._groups != (id(groups), len(groups)):
            self._index = {q: (g, i) for g, group in enumerate(groups) for i, q in enumerate(group["params"])}
            self._groups = (id(groups), len(groups))
        return groups[self._index[p][0]]

    def _warn_kept(self) -> None:
        if self.accumulation_steps == 1 and not self._warned_kept:
            self._warned_kept = True
            warnings.warn(
                f"{_NAME}: with max_grad_norm, loss.backward() cannot step in the backward (the norm needs every "
                "gradient first): the gradients are kept and optimizer.step() clips and steps them, saving no "
                "memory; call optimizer.backward(loss) instead",
                stacklevel=3,
            )


class _Slices:
    """One parameter's step taken slice by slice (`SLICE_BYTES`; the last slice takes the rest, so none is smaller:
    bitsandbytes keeps a small tensor's state in 32 bits): each slice a flat view of the parameter holding
    the matching views of its gradient and of its state (bitsandbytes' per-block scales sliced by block), the
    scalars (the step count) stepped from the same value in each slice and written back once. On the first step
    each slice makes its own state, gathered into the parameter's (as large as the optimizer would have made it)."""

    def __init__(self, optimizer: torch.optim.Optimizer, p: torch.Tensor, length: int) -> None:
        self.optimizer, self.p, self.length = optimizer, p, length

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, p: torch.Tensor) -> _Slices | None:
        """`p`'s slices, or None where it is stepped whole: small, not contiguous, a state that cannot be sliced
        or an optimizer whose update is not elementwise."""
        length = max(_ALIGN, SLICE_BYTES // p.element_size() // _ALIGN * _ALIGN)
        if p.numel() <= 2 * length or not _elementwise(optimizer):
            return None
        if not (p.is_contiguous() and p.grad.layout == torch.strided and p.grad.is_contiguous()):
            return None
        state = optimizer.state.get(p)
        if state and any(_kind(key, value, p.numel()) is None for key, value in state.items()):
            return None
        return cls(optimizer, p, length)

    def step(self, step_alone: Callable[[torch.Tensor], None]) -> None:
        """`step_alone(piece)` for each slice, with the slice's state in the optimizer's `state[piece]`."""
        p, states = self.p, self.optimizer.state
        whole = dict(states.get(p) or {})  # the state before this step: each slice's scalars start from it
        flat, grad, numel = p.detach().view(-1), p.grad.view(-1), p.numel()
        gathered: dict[str, Any] = {}
        for start in range(0, numel - self.length + 1, self.length):
            stop = numel if start + 2 * self.length > numel else start + self.length  # no short slice at the end
            piece = flat[start:stop]
            piece.grad = grad[start:stop]
            views = {key: _slice(_kind(key, value, numel), value, start, stop) for key, value in whole.items()}
            states[piece] = dict(views)
            try:
                step_alone(piece)
            finally:
                stepped = states.pop(piece, {})
            for key, value in stepped.items():
                kind = _kind(key, value, stop - start)
                if key in views and value is not views[key] and kind in ("element", "block"):
                    views[key].copy_(value)  # the optimizer replaced a state tensor rather than updating it in place
                elif key not in views or kind == "scalar":
                    _gather(gathered, key, kind, value, p, start, stop)
        states[p] = {**whole, **gathered}


def _kind(key: str, value: Any, numel: int) -> str | None:
    """How a state entry of a parameter (or slice) of `numel` elements is sliced: per element, per bitsandbytes
    block, shared by every slice (bitsandbytes' quantization maps), a scalar; None where it cannot be."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return "scalar"
    if value.numel() == numel and value.is_contiguous():
        return "element"
    if key in ("absmax1", "absmax2") and value.numel() == -(-numel // _BLOCK):
        return "block"
    return "shared" if key in ("qmap1", "qmap2") else None


def _slice(kind: str | None, value: Any, start: int, stop: int) -> Any:
    if kind == "element":
        return value.view(-1)[start:stop]
    if kind == "block":
        return value[start // _BLOCK : -(-stop // _BLOCK)]
    return value.clone() if kind == "scalar" and isinstance(value, torch.Tensor) else value


def _gather(gathered: dict[str, Any], key: str, kind: str | None, value: Any, p: torch.Tensor, start: int,
            stop: int) -> None:  # fmt: skip
    """A slice's new state entry put into the parameter's: per-element and per-block entries into tensors of the
    parameter's size, made at the first slice; a scalar's last value (every slice's is the same)."""
    if kind in ("element", "block"):
        if key not in gathered:
            size = p.shape if kind == "element" else (-(-p.numel() // _BLOCK),)
            gathered[key] = torch.empty(size, dtype=value.dtype, device=value.device)
        if gathered[key].dtype != value.dtype:  # e.g. bitsandbytes keeps a small tensor's state in 32 bits
            raise RuntimeError(f"{_NAME}: the slices of one parameter made {key!r} of two dtypes; please report it")
        _slice(kind, gathered[key], start, stop).copy_(value)
    elif kind == "scalar" or (kind == "shared" and key not in gathered):
        gathered[key] = value
    elif kind is None:
        raise RuntimeError(
            f"{_NAME}: {type(p).__name__} state entry {key!r} of shape {tuple(value.shape)} is neither per element "
            "nor a scalar: this optimizer cannot be stepped in slices; please report it"
        )


def _elementwise(optimizer: torch.optim.Optimizer) -> bool:
    if type(optimizer) in _ELEMENTWISE:
        return not any(group.get("differentiable") for group in optimizer.param_groups)
    if _is_bitsandbytes(optimizer):  # not its per-tensor update clipping (max_unorm), LAMB's or LARS's trust ratio
        name = type(optimizer).__name__
        return bool(_ELEMENTWISE_BITSANDBYTES.fullmatch(name)) and not getattr(optimizer.args, "max_unorm", 0.0)
    return False


def _is_bitsandbytes(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__module__.startswith("bitsandbytes.") and hasattr(optimizer, "update_step")


def _bitsandbytes_step(optimizer: Any, p: torch.Tensor, gindex: int, pindex: int) -> None:
    """bitsandbytes' `Optimizer8bit.step` for one parameter (or a slice of it) at its group's and its own index
    (`gindex`, `pindex`): its per-parameter settings (`GlobalOptimManager` overrides) are found by them."""
    if not optimizer.initialized:
        optimizer.check_overrides()  # over every group, as its first step() would
        optimizer.to_gpu()
        optimizer.initialized = True
    group = optimizer.param_groups[gindex]
    if not optimizer.state[p]:
        optimizer.init_state(group, p, gindex, pindex)
    optimizer.prefetch_state(p)
    optimizer.update_step(group, p, gindex, pindex)
    if p.device.type == "cuda":  # as its step() does after each parameter (paged state is updated asynchronously)
        torch.cuda.synchronize(p.device)


def optimizer_in_backward(
    optimizer: torch.optim.Optimizer, *, max_grad_norm: float | None = None, accumulation_steps: int = 1
) -> OptimizerInBackward:
    """Step `optimizer` during the backward, one parameter at a time as its gradient completes, freeing it.

    Args:
        optimizer: any torch.optim.Optimizer built from parameter groups (SGD, Adam, AdamW with for-loop,
            foreach or fused kernels, ...); its state and state_dict stay its own.
        max_grad_norm: clip by the global L2 norm of all gradients, exactly as `clip_grad_norm_` before
            `step()` would; call `.backward(loss)` so that the norm is known before the first step.
        accumulation_steps: micro-steps per optimizer step; a parameter is stepped in the backward of its last.

    Returns:
        An OptimizerInBackward: keep calling its `step()` and `zero_grad()` (and an LR scheduler built on it);
        `remove()` takes its hooks off.

    Example:
        optimizer = fastckpt.optimizer_in_backward(torch.optim.AdamW(model.parameters()), max_grad_norm=1.0)
        optimizer.backward(model(x).loss); optimizer.step(); optimizer.zero_grad()
    """
    return OptimizerInBackward(optimizer, max_grad_norm=max_grad_norm, accumulation_steps=accumulation_steps)


def _total_norm(norms: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of the per-parameter norms, as torch.nn.utils.clip_grad_norm_ combines them."""
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))


def _clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """clip_grad_norm_'s factor: max_norm / (total + 1e-6), at most 1."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def _check(optimizer: Any, max_grad_norm: Any, accumulation_steps: Any) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, OptimizerInBackward):
        raise TypeError(
            f"{_NAME}: `optimizer` must be a torch.optim.Optimizer (not already stepped in the backward), got "
            f"{type(optimizer).__name__}"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            f"{_NAME}: LBFGS cannot be stepped in the backward: its step evaluates the loss again (a closure) over "
            "all parameters at once"
        )
    if max_grad_norm is not None and (
        isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0
        or not math.isfinite(max_grad_norm)
    ):  # fmt: skip
        raise ValueError(f"{_NAME}: `max_grad_norm` must be a positive finite number or None, got {max_grad_norm!r}")
    if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int) or accumulation_steps < 1:
        raise ValueError(f"{_NAME}: `accumulation_steps` must be an int >= 1, got {accumulation_steps!r}")
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            f"{_NAME}: not under torch.distributed with {dist.get_world_size()} ranks: DDP, FSDP2 and DeepSpeed "
            "reduce a gradient across ranks after its accumulation hook fires, so the step would use this rank's "
            "gradient alone; use the plain optimizer there"
        )
    for group in optimizer.param_groups:
        for p in group["params"]:
            if hasattr(p, "ds_id") or type(p).__name__ == "DTensor":
                raise ValueError(
                    f"{_NAME}: the parameters are managed by {'DeepSpeed ZeRO' if hasattr(p, 'ds_id') else 'FSDP2'}"
                    ", which reduces and shards their gradients after the accumulation hook fires; use the plain "
                    "optimizer there"
                )

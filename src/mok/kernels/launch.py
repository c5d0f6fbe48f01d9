"""Kernel launches with a fraction of the host work of `kernel[grid](...)`.

Triton's launch binds every argument to the kernel's signature, specializes each one in C++,
builds a string key from the specialization and the options, looks the compiled kernel up, checks
the globals it captured and asks for launch metadata: host work that made up most of a small
layer's time (measured: benchmarks/results/2026-12-02-issue15-host-time-h200.md).
`fast_launch(kernel)` keeps a table of compiled kernels keyed by what Triton specializes on,
computed directly from the arguments:

- a tensor: its dtype and whether its address is 16-byte aligned;
- an int: whether it is 1, whether it is a multiple of 16, and its integer type (i32, i64, u64);
- a bool, a float, None: the type alone (None: the value);
- a tuple: the keys of its elements (tuples hold no descriptors: Triton's launcher takes those
  as arguments of their own);
- a tensor descriptor (or a `DeferredDescriptor`): its dtype, block shape and shared-memory
  layout;
- the keyword arguments (constexprs, num_warps, ...): their values;

so two calls with the same key run the same compiled kernel that Triton itself would pick. The
first call of a key goes through Triton's own launch (compiling if needed) and records the
argument list for the direct launch, where the positional arguments are replaced by each call's.

A kernel with TMA descriptors (Gluon's) has each descriptor encoded into a CUtensorMap on the
host at every launch by Triton's launcher (up to nine per launch). The direct launch
calls the compiled launcher beneath that step and keeps the encodings, keyed by what they encode
(address, shape, strides; the block, swizzle and dtype are the compiled kernel's): a tensor at
the same address with the same shape has the same encoding, whichever tensor it is, and the
encoding holds no reference to it.

Triton's standard path is kept where this one cannot be sure: under the interpreter, with a
launch hook set (profilers), for a grid given as a function, for a keyword argument that is not
a constexpr or a launch option, for an argument of another kind, and when Triton's internals are
not the ones this was written for (checked on the first launch). The table keeps no tensor of any
call. `MOK_TRITON_LAUNCH=standard` turns the fast path off.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver

from mok.kernels._triton_compat import interpreting

try:
    from triton.backends.nvidia.driver import make_tensordesc_arg as _make_tensordesc_arg
except ImportError:  # another Triton, or no NVIDIA backend: descriptors go through Triton's step
    _make_tensordesc_arg = None

MAX_KEYS = 256
"""Compiled kernels remembered per kernel; beyond it the table starts over (new shapes of ints
or alignments each make a key)."""
MAX_ENCODINGS = 1024
"""TMA descriptor encodings remembered per compiled kernel; beyond it the table starts over."""

_I32 = range(-(2**31), 2**31)
_I64 = range(-(2**63), 2**63)


def enabled() -> bool:
    """Whether launches take the direct path (off under the interpreter, or when
    MOK_TRITON_LAUNCH=standard)."""
    return not interpreting() and os.environ.get("MOK_TRITON_LAUNCH", "fast") != "standard"


def _tensor_key(arg: torch.Tensor):
    return (arg.dtype, arg.data_ptr() % 16 == 0)


def _int_key(arg: int):
    kind = "i32" if arg in _I32 else "i64" if arg in _I64 else "u64"
    return (kind, arg == 1, arg % 16 == 0)


def _descriptor_key(arg):
    # A descriptor's layout is keyed by identity (`warp_specialized` makes one object per
    # layout): a fresh but equal layout only misses.
    return (arg.base.dtype, tuple(arg.block_shape), id(getattr(arg, "layout", None)), arg.padding)


def _tuple_key(arg: tuple):
    # Triton specializes a tuple's elements as it does arguments (an int of 1 becomes a
    # constexpr there, whatever `do_not_specialize` says).
    return tuple(map(_arg_key, arg))


_KEYS_BY_TYPE: dict[type, Callable[[Any], Any]] = {
    torch.Tensor: _tensor_key,
    bool: lambda arg: bool,
    int: _int_key,
    float: lambda arg: float,
    type(None): lambda arg: None,
    tuple: _tuple_key,
}
"""How to key an argument, by its exact type (`_arg_key` adds the subclasses it meets)."""


def _arg_key(arg: Any):
    """What Triton's specialization of `arg` depends on (see the module docstring), or raises
    TypeError for a kind of argument this does not know."""
    key = _KEYS_BY_TYPE.get(type(arg))
    if key is not None:
        return key(arg)
    if isinstance(arg, torch.Tensor):  # a subclass: nn.Parameter, ...
        key = _tensor_key
    elif isinstance(arg, bool):
        key = _KEYS_BY_TYPE[bool]
    elif isinstance(arg, int):
        key = _int_key
    elif isinstance(arg, float):
        key = _KEYS_BY_TYPE[float]
    elif getattr(arg, "block_shape", None) is not None and isinstance(
        getattr(arg, "base", None), torch.Tensor
    ):
        key = _descriptor_key
    else:
        raise TypeError(f"no launch key for a {type(arg).__name__}")
    _KEYS_BY_TYPE[type(arg)] = key
    return key(arg)


class DeferredDescriptor:
    """A TMA descriptor's fields, as a Triton descriptor class (`kind`, e.g. Gluon's
    `TensorDescriptor`) takes them, without building that object and running its checks:
    `make()` builds it where Triton's own launch needs one and where the direct launch encodes a
    tensor it has not met (a tensor it met has passed the checks with these fields)."""

    __slots__ = ("kind", "base", "shape", "strides", "block_shape", "layout", "padding")

    def __init__(self, kind, base: torch.Tensor, block_shape: list[int], layout, padding="zero"):
        self.kind = kind
        self.base = base
        self.shape = base.shape
        self.strides = base.stride()
        self.block_shape = block_shape
        self.layout = layout
        self.padding = padding

    def make(self):
        """The Triton descriptor (raises as it does for fields it does not take)."""
        return self.kind(
            self.base, self.shape, self.strides, self.block_shape, self.layout, self.padding
        )


def _made(args) -> tuple:
    """`args` with every `DeferredDescriptor` made."""
    return tuple(a.make() if type(a) is DeferredDescriptor else a for a in args)


class _Encoded:
    """The launcher beneath Triton's TMA-descriptor step and the encodings it was given."""

    __slots__ = ("launcher", "descriptors", "encodings")

    def __init__(self, launcher, descriptors: dict[int, Any]):
        self.launcher = launcher  # called as the compiled kernel's `run`
        self.descriptors = descriptors  # argument position -> its encoding's metadata
        self.encodings: dict[tuple, list] = {}

    def arguments(self, values: list) -> list:
        """The kernel's arguments as the launcher takes them: each descriptor as its encoding
        (a CUtensorMap, the shape and the strides)."""
        final = []
        descriptors, encodings = self.descriptors, self.encodings
        for position, value in enumerate(values):
            meta = descriptors.get(position)
            if meta is None:
                final.append(value)
                continue
            key = (position, value.base.data_ptr(), tuple(value.shape), tuple(value.strides))
            encoded = encodings.get(key)
            if encoded is None:
                if type(value) is DeferredDescriptor:
                    value = value.make()
                if len(encodings) >= MAX_ENCODINGS:
                    encodings.clear()
                encoded = encodings[key] = _make_tensordesc_arg(value, meta)
            final.extend(encoded)
        return final


class _Direct:
    """One compiled kernel and the argument list its direct launch fills in."""

    __slots__ = ("compiled", "template", "positional", "layout", "encoded")

    def __init__(
        self, compiled, template: list, positional: int, layout: Any, encoded: _Encoded | None
    ):
        self.compiled = compiled
        self.template = template
        self.positional = positional
        self.layout = layout  # keeps the descriptors' layouts (keyed by id) alive; no tensors
        self.encoded = encoded


class FastLaunch:
    """A Triton kernel launched as `kernel[grid](*args, **kwargs)`, directly where it can (see
    the module docstring). Every other attribute is the wrapped kernel's."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._direct: dict[tuple, _Direct | None] = {}

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __getitem__(self, grid) -> Callable[..., Any]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        """Run the kernel on `grid` (a tuple of 1-3 ints) with these arguments."""
        if not enabled() or _hooked() or callable(grid):
            return self.kernel[grid](*_made(args), **kwargs)
        active = driver.active
        device = active.get_current_device()
        try:
            key = (device, *map(_arg_key, args), *kwargs.items())
            direct = self._direct.get(key, False)
        except TypeError:  # an argument of another kind, or an unhashable keyword value
            return self.kernel[grid](*_made(args), **kwargs)
        if direct is False:
            args = _made(args)
            compiled = self.kernel[grid](*args, **kwargs)
            if len(self._direct) >= MAX_KEYS:
                self._direct.clear()
            self._direct[key] = self._record(compiled, device, args, kwargs)
            return compiled
        if direct is None:
            return self.kernel[grid](*_made(args), **kwargs)
        values = direct.template.copy()
        values[: direct.positional] = args
        compiled = direct.compiled
        stream = active.get_current_stream(device)
        grid = (*grid, 1, 1)
        encoded = direct.encoded
        run = compiled.run
        if encoded is not None:
            run, values = encoded.launcher, encoded.arguments(values)
        else:
            values = _made(values)
        run(
            grid[0],
            grid[1],
            grid[2],
            stream,
            compiled.function,
            compiled.packed_metadata,
            None,
            None,
            None,
            *values,
        )
        return compiled

    def _record(self, compiled, device: int, args: tuple, kwargs: dict) -> _Direct | None:
        """The direct launch of the kernel Triton just ran, or None where this path cannot
        reproduce Triton's (then every call of this key takes the standard path)."""
        kernel = self.kernel
        try:
            binder = kernel.device_caches[device][4]
            bound, _, _ = binder(*args, **kwargs)
            params = kernel.params
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            compiled.run, compiled.function, compiled.packed_metadata  # noqa: B018
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            return None
        names = list(bound)
        if names != [p.name for p in params] or len(args) > len(names):
            return None
        # A keyword argument that is a run-time parameter would be frozen by the template.
        if any(not p.is_constexpr for p in params if p.name in kwargs):
            return None
        layouts = [getattr(a, "layout", None) for a in args]
        # The call's own arguments are not kept: every launch puts its own in these places, and
        # holding this call's tensors would keep their memory, and any autograd graph behind
        # them, alive for as long as the kernel's table.
        template = [None] * len(args) + list(bound.values())[len(args) :]
        return _Direct(compiled, template, len(args), layouts, _encoded_launch(compiled))


def _encoded_launch(compiled) -> _Encoded | None:
    """Triton's launcher of `compiled` with the step that encodes its TMA descriptors taken out,
    where its descriptors are encoded (Gluon's, with their metadata); None otherwise (the launch
    then goes through Triton's launcher whole)."""
    run = compiled.run
    try:
        step = run.launch
        cells = dict(
            zip(
                step.__code__.co_freevars,
                (c.cell_contents for c in step.__closure__ or ()),
                strict=True,
            )
        )
        raw, indices, metas = (
            cells["launcher"],
            cells["tensordesc_indices"],
            cells["tensordesc_meta"],
        )
        launcher = copy.copy(run)  # its scratch allocation and launch options, run's own
        launcher.launch = raw
    except (AttributeError, KeyError, TypeError, ValueError):
        return None
    if _make_tensordesc_arg is None or not metas or any(m is None for m in metas):
        return None
    return _Encoded(launcher, dict(zip(sorted(indices), metas, strict=True)))


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler's): Triton's own path calls it."""
    hook = knobs.runtime.launch_enter_hook
    # None, or (Triton >= 3.5) a chain of hooks that is empty unless one was added.
    return hook is not None and bool(getattr(hook, "calls", True))


def fast_launch(kernel) -> FastLaunch:
    """`kernel` (a `triton.jit` or `gluon.jit` function) launched through `FastLaunch`."""
    return FastLaunch(kernel)

"""`mok.kernels.launch`: the direct launch runs the kernel Triton would pick, with the call's
arguments.

Bugs these catch: a launch key that misses something Triton specializes on (an unaligned pointer
run by a kernel compiled for aligned ones, an int of 1 that Triton folds into the code as a
constant, an i64 value passed to an i32 parameter, another dtype), an argument list whose
positions are shifted (the template's constexprs or defaults out of place), the first call's
arguments replayed instead of the current ones, keyword arguments that are not constexprs frozen
into the template.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import triton
import triton.language as tl

from mok.kernels import launch
from mok.kernels.launch import DeferredDescriptor, FastLaunch, fast_launch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@fast_launch
@triton.jit
def _scale_shift_kernel(x, y, n, scale, shift, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    value = tl.load(x + offsets, mask=mask).to(tl.float32) * scale + shift
    if SQUARE:
        value = value * value
    tl.store(y + offsets, value.to(y.dtype.element_ty), mask=mask)


def _scale_shift(x: torch.Tensor, n: int, scale: float, shift: int, block: int, **kwargs):
    y = torch.full_like(x, -7)
    _scale_shift_kernel[(triton.cdiv(n, block),)](x, y, n, scale, shift, BLOCK=block, **kwargs)
    return y


def _expected(x, n, scale, shift, square=False):
    y = torch.full_like(x, -7)
    value = x[:n].float() * scale + shift
    y[:n] = (value * value if square else value).to(x.dtype)
    return y


def test_keys_separate_what_triton_specializes_on():
    base = torch.zeros(64)
    aligned, unaligned = base[4:], base[1:]  # 16 and 4 bytes past a 16-byte aligned start
    assert launch._arg_key(aligned) == launch._arg_key(base)
    assert launch._arg_key(unaligned) != launch._arg_key(aligned)
    assert launch._arg_key(base.double()) != launch._arg_key(base)
    ints = [1, 2, 16, 32, 17, 2**31, 2**31 + 5, 2**63, -16]
    keys = [launch._arg_key(v) for v in ints]
    assert keys[2] == keys[3] and keys[1] == keys[4]  # multiples of 16 alike, others alike
    assert len({keys[0], keys[1], keys[2], keys[5], keys[6], keys[7]}) == 6
    assert keys[8] == keys[2]
    assert launch._arg_key(True) != launch._arg_key(1)
    assert launch._arg_key(1.0) != launch._arg_key(1)
    with pytest.raises(TypeError):
        launch._arg_key([1, 2])


def test_a_tuples_key_is_its_elements_keys():
    """Triton specializes the elements of a tuple argument one by one (a 1 inside becomes a
    constant, whatever `do_not_specialize` says): a tuple keys by its elements, nested ones
    too, and an absent part (None) keys apart from a present one."""
    base = torch.zeros(64)
    aligned, unaligned = base[4:], base[1:]
    key = launch._arg_key
    assert key((aligned, 2, 2.0)) == key((base, 3, 0.5))
    assert key((aligned, 2)) != key((unaligned, 2))
    assert key((aligned, 1)) != key((aligned, 2)) != key((aligned, 32))
    assert key((aligned, (1, None))) != key((aligned, (2, None)))
    assert key((aligned, None)) != key((aligned, aligned))
    assert key((aligned,)) != key(aligned)


def test_under_the_interpreter_or_when_turned_off_launches_take_tritons_path(monkeypatch):
    monkeypatch.setenv("MOK_TRITON_LAUNCH", "standard")
    assert not launch.enabled()
    x = torch.randn(100, device=DEVICE)
    assert torch.equal(_scale_shift(x, 100, 2.0, 3, 32), _expected(x, 100, 2.0, 3))


@dataclasses.dataclass
class _Descriptor:
    """A stand-in for Triton's descriptor class (the fields DeferredDescriptor hands it)."""

    base: torch.Tensor
    shape: tuple
    strides: tuple
    block_shape: list
    layout: object
    padding: str


def test_encoded_launch_hands_the_launcher_what_tritons_descriptor_step_would(monkeypatch):
    """Against a launcher built as Triton 3.6 builds one (a wrapper closing over the raw
    launcher, the descriptors' positions and their metadata, that encodes each descriptor at
    every launch): the direct launch hands the raw launcher the same arguments, encodes each
    (address, shape, strides) once, and encodes a tensor at a new address anew. Catches
    metadata paired with the wrong descriptor, encodings put at the wrong positions, one
    tensor's encoding reused for another (it would read the first tensor's memory)."""
    encoded = []

    def encode(descriptor, meta):
        encoded.append(descriptor.base.data_ptr())
        address = descriptor.base.data_ptr()
        return [("tensor map", address, meta["swizzle"]), *descriptor.shape, *descriptor.strides]

    monkeypatch.setattr(launch, "_make_tensordesc_arg", encode)

    def wrap(launcher, tensordesc_indices, tensordesc_meta):  # Triton 3.6's, in substance
        def inner(*args):
            final, k = list(args[:13]), 0
            for i, arg in enumerate(args[13:]):
                if i in tensordesc_indices:
                    final.extend(encode(arg, tensordesc_meta[k]))
                    k += 1
                else:
                    final.append(arg)
            return launcher(*final)

        return inner

    class Run:  # Triton's CudaLauncher: its launch options, then `self.launch`
        def __init__(self, step):
            self.launch = step

        def __call__(self, gx, gy, gz, stream, function, *args):
            self.launch(gx, gy, gz, stream, function, False, False, None, None, *args)

    received = []
    metas = [{"swizzle": 128}, {"swizzle": 64}]
    compiled = types.SimpleNamespace(
        run=Run(wrap(lambda *a: received.append(a), {3, 0}, metas)),
        function="function",
        packed_metadata="metadata",
    )
    direct = launch._encoded_launch(compiled)
    assert direct is not None and direct.descriptors == {0: metas[0], 3: metas[1]}
    base = ("grid", 1, 1, "stream", "function", "metadata", None, None, None)
    a, b = torch.zeros(8, 32), torch.zeros(16, 32)
    for x in (a, a, b):
        values = [
            DeferredDescriptor(_Descriptor, x, [8, 32], None),
            "pointer",
            5,
            DeferredDescriptor(_Descriptor, x[:4], [4, 32], None),
            3,
        ]
        compiled.run(*base, *launch._made(values))
        direct.launcher(*base, *direct.arguments(values))
        assert received[-1] == received[-2]
    # Triton's step encoded at every launch (6 times); the direct one each distinct tensor once.
    assert len(encoded) == 6 + 2 * 2


def test_launchers_of_other_shapes_keep_tritons_descriptor_step():
    """A launcher whose wrapper does not close over what Triton 3.6's does (another Triton):
    no direct encoding, so the launch goes through Triton's launcher whole."""
    compiled = types.SimpleNamespace(run=types.SimpleNamespace(launch=lambda *args: None))
    assert launch._encoded_launch(compiled) is None


@pytest.mark.gpu
def test_direct_launches_equal_tritons_for_every_specialization():
    """Calls that alternate between keys after each was recorded: each must run its own
    specialization with its own arguments."""
    kernel = FastLaunch(_scale_shift_kernel.kernel)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    base = torch.randn(4096, device=DEVICE, generator=generator)
    halves = base.half()
    cases = [
        (base, 4000, 2.0, 3, 128, {}),
        (base[1:], 4000, 0.5, 1, 128, {}),  # unaligned pointer; shift == 1 (a constant)
        (base[4:], 3001, -1.0, 16, 128, {}),  # aligned again, n not a multiple of 16
        (halves, 4096, 1.5, 2**31 + 5, 64, {}),  # another dtype; an i64 shift
        (base, 4000, 2.0, 3, 128, {"SQUARE": True}),  # a constexpr keyword
        (base, 4000, 2.0, 3, 128, {"num_warps": 2}),  # a launch option
    ]
    for repeat in range(3):
        for x, n, scale, shift, block, kwargs in cases:
            x = x + repeat  # new values, new addresses
            y = torch.full_like(x, -7)
            kernel[(triton.cdiv(n, block),)](x, y, n, scale, shift, BLOCK=block, **kwargs)
            expected = _expected(x, n, scale, shift, kwargs.get("SQUARE", False))
            assert torch.equal(y, expected), (repeat, n, shift, kwargs)
    recorded = [direct for direct in kernel._direct.values() if direct is not None]
    assert len(recorded) == len(cases)  # one key per case, every one launched directly


@fast_launch
@triton.jit
def _tuple_scale_shift_kernel(rows, n, coefficients, addend, BLOCK: tl.constexpr):
    x, y = rows
    scale, shift = coefficients
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    value = tl.load(x + offsets, mask=mask).to(tl.float32) * scale + shift
    if addend is not None:
        value = value + tl.load(addend + offsets, mask=mask).to(tl.float32)
    tl.store(y + offsets, value.to(y.dtype.element_ty), mask=mask)


@pytest.mark.gpu
def test_direct_launches_of_tuple_arguments_equal_tritons():
    """Tuple arguments (how the expert kernels take their parts) alternating between
    specializations of their elements, and a part present or absent (None): each call runs its
    own specialization with its own arguments."""
    kernel = FastLaunch(_tuple_scale_shift_kernel.kernel)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    base = torch.randn(4096, device=DEVICE, generator=generator)
    addend = torch.randn(4096, device=DEVICE, generator=generator)
    cases = [
        (base, 4000, (2.0, 3), None),
        (base[1:], 4000, (0.5, 1), None),  # unaligned pointer in a tuple; a 1 (a constant)
        (base[4:], 3001, (-1.0, 16), addend),  # the optional part present
        (base.half(), 4095, (1.5, 2**31 + 5), addend[1:]),  # another dtype; an i64 element
    ]
    for repeat in range(3):
        for x, n, (scale, shift), extra in cases:
            x = x + repeat  # new values, new addresses
            y = torch.full_like(x, -7)
            kernel[(triton.cdiv(n, 128),)]((x, y), n, (scale, shift), extra, BLOCK=128)
            expected = _expected(x, n, scale, shift)
            if extra is not None:
                expected[:n] = (x[:n].float() * scale + shift + extra[:n]).to(x.dtype)
            assert torch.equal(y, expected), (repeat, n, shift)
    recorded = [direct for direct in kernel._direct.values() if direct is not None]
    assert len(recorded) == len(cases)


@pytest.mark.gpu
def test_a_runtime_keyword_argument_keeps_tritons_path():
    """`n` given by keyword would be frozen into the template: such keys never go direct."""
    kernel = FastLaunch(_scale_shift_kernel.kernel)
    x = torch.randn(512, device=DEVICE)
    for n in (500, 300, 100):
        y = torch.full_like(x, -7)
        kernel[(4,)](x, y, scale=1.0, shift=2, BLOCK=128, n=n)
        assert torch.equal(y, _expected(x, n, 1.0, 2))
    assert all(direct is None for direct in kernel._direct.values())


@pytest.mark.gpu
def test_a_launch_hook_keeps_tritons_path():
    """A profiler's launch hook must see every launch: none goes direct while one is set."""
    from triton import knobs

    kernel = FastLaunch(_scale_shift_kernel.kernel)
    x = torch.randn(512, device=DEVICE)
    seen = []
    knobs.runtime.launch_enter_hook.add(seen.append)
    try:
        for _ in range(3):
            y = torch.full_like(x, -7)
            kernel[(4,)](x, y, 500, 1.0, 2, BLOCK=128)
            assert torch.equal(y, _expected(x, 500, 1.0, 2))
    finally:
        knobs.runtime.launch_enter_hook.remove(seen.append)
    assert len(seen) == 3 and not kernel._direct


@pytest.mark.gpu
def test_the_expert_kernels_launch_directly_with_tritons_results(monkeypatch):
    """Every kernel of the expert MLP, Gluon ones included (their descriptors and layout
    constexprs must make keys that repeat from call to call), takes the direct path from its
    second call on, Gluon's with their TMA descriptors' encodings kept, and forward and backward
    equal those of Triton's own launches bit for bit, for inputs that change values and
    addresses from call to call (the earlier ones kept alive: an encoding of an earlier call's
    tensor would read its values instead)."""
    from mok.kernels import expert_mlp, warp_specialized

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    experts, hidden, inter, rows = 4, 256, 128, 700

    def randn(*shape):
        return (torch.randn(*shape, generator=generator, device=DEVICE) / 8).bfloat16()

    w_gate, w_up = randn(experts, inter, hidden), randn(experts, inter, hidden)
    w_down = randn(experts, hidden, inter)
    offsets = torch.tensor([0, 100, 100, 450, 690], dtype=torch.int32, device=DEVICE)

    def run(x, grad):
        out, saved = expert_mlp.expert_mlp_forward(x, offsets, w_gate, w_up, w_down)
        return [out[:690], *expert_mlp.expert_mlp_backward(grad, saved)]

    gluon_kernels = (warp_specialized._row_tiles_kernel, warp_specialized._weight_gradient_kernel)
    for kernel in gluon_kernels:
        kernel._direct.clear()  # other tests of this process launched other shapes
    kept = []
    for _ in range(4):
        x, grad = randn(rows, hidden), randn(rows, hidden)
        kept.append((x, grad))
        monkeypatch.setenv("MOK_TRITON_LAUNCH", "standard")
        expected = run(x, grad)
        monkeypatch.setenv("MOK_TRITON_LAUNCH", "fast")
        for got, want in zip(run(x, grad), expected, strict=True):
            assert torch.equal(got, want)
    if warp_specialized.available(torch.device(DEVICE)):
        for kernel in gluon_kernels:
            assert kernel._direct and all(d is not None for d in kernel._direct.values())
            # One key per product (four modes of _row_tiles_kernel, two of
            # _weight_gradient_kernel): keys repeat.
            assert len(kernel._direct) <= 4
            # Triton 3.6's launcher: the descriptors' encodings kept, one per distinct tensor.
            assert all(d.encoded is not None for d in kernel._direct.values())
            assert any(d.encoded.encodings for d in kernel._direct.values())


@pytest.mark.gpu
def test_the_table_keeps_no_tensor_of_a_launch_alive():
    """A launch's tensors must be freed with their last reference: the table holding them kept
    gigabytes alive across calls and an autograd graph alive into a later CUDA graph capture."""
    import weakref

    kernel = FastLaunch(_scale_shift_kernel.kernel)
    x = torch.randn(512, device=DEVICE)
    y = torch.empty_like(x)
    for _ in range(2):
        kernel[(4,)](x, y, 500, 1.0, 2, BLOCK=128)
    alive = weakref.ref(x), weakref.ref(y)
    del x, y
    assert [ref() for ref in alive] == [None, None]

"""A workaround for Triton's CPU interpreter, applied only when TRITON_INTERPRET=1.

Triton 3.6's interpreter holds scalar kernel arguments as 1-element numpy arrays and converts them
with `int(array)`, which numpy >= 2.4 rejects ("only 0-dimensional arrays can be converted to Python
scalars"), so any loop with a run-time bound fails. Upstream fixed it in triton-lang/triton#9172
(issue #9171); this module applies the same one-line fix. Remove it once the oldest supported Triton
carries that fix.
"""

from __future__ import annotations

import os


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def patch_interpreter() -> None:
    """Make the interpreter's scalar-to-index conversion work with numpy >= 2.4 (idempotent)."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_mok_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mok_patched = True
    interpreter._patch_lang_tensor = patched

"""Without a GPU the kernel tests run Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET before
anything imports Triton, and imports this module). With a GPU they run compiled kernels (and test_gpu.py runs too).
Worker processes that run the kernels import this module themselves.

Two patches of Triton 3.6's interpreter (they touch nothing that runs on a GPU):
- a runtime loop bound becomes an index through ``int(array)``, which NumPy >= 2.4 rejects for its 1-element
  arrays ("only 0-dimensional arrays can be converted to Python scalars"): take the element instead;
- ``tl.dot`` on bfloat16 multiplies the raw uint16 bit patterns the interpreter stores bf16 in: widen them to
  float32 first (exact: a bf16 is the top half of a float32).
"""

try:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter
except ImportError:  # no Triton: the kernel tests skip
    interpreter = None


def _bf16_to_f32(h):
    data = (h.data.astype(np.uint32) << 16).view(np.float32)
    return interpreter.TensorHandle(data, tl.float32)


if interpreter is not None and hasattr(interpreter, "_patch_lang_tensor") and not hasattr(interpreter, "_matrixopt"):
    interpreter._matrixopt = True  # patched once per process
    _patch_lang_tensor = interpreter._patch_lang_tensor

    def _patch_lang_tensor_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor_index

    _create_dot = interpreter.InterpreterBuilder.create_dot

    def _create_dot_bf16(self, a, b, d, *args):
        a = _bf16_to_f32(a) if a.dtype == tl.bfloat16 else a
        b = _bf16_to_f32(b) if b.dtype == tl.bfloat16 else b
        return _create_dot(self, a, b, d, *args)

    interpreter.InterpreterBuilder.create_dot = _create_dot_bf16

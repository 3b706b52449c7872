"""A faster Triton interpreter for the test suite: the same semantics, without re-patching the language.

Under ``TRITON_INTERPRET=1`` a kernel launch patches ``triton.language`` (and ``.core``, ``.math``,
the tensor class) so that its builtins run on NumPy, and restores it when the launch ends. But
every call of a ``@triton.jit`` helper from inside the kernel patches the same modules again
(``InterpretedFunction.__call__``), through ``inspect.getmembers`` of each module: ~0.8 ms per
helper call (cProfile of one Triton optimizer test: ~4,500 calls, 3.7 s), repeated for every
program instance. This suite's kernels call helpers (Philox
rounds, Box-Muller, the clip and optimizer math) thousands of times per test, which cost about a
third of the Triton tests' time (test_optim.py's Triton cases: 221 s before, 147 s after, run side
by side). Here a helper call patches only the language modules its own globals see that the
current launch has not patched yet: the modules and their patched attributes are exactly those
the repeated patching would set again, so every kernel computes what it computed before.

Applied only when the interpreter has the private members this relies on (checked on Triton
3.8); otherwise the interpreter runs unchanged.
"""

from __future__ import annotations


def install() -> bool:
    """Patch the interpreter in this process; True if it was patched."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:
        return False
    grid_executor = getattr(interp, "GridExecutor", None)
    function = getattr(interp, "InterpretedFunction", None)
    patch_lang = getattr(interp, "_patch_lang", None)
    error = getattr(interp, "InterpreterError", None)
    if None in (grid_executor, function, patch_lang, error) or not hasattr(function, "rewrite"):
        return False

    patched: set[int] = set()  # ids of the language modules patched by the current launch

    def langs(fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang_tracked(fn):
        patched.update(langs(fn))
        return patch_lang(fn)

    launch = grid_executor.__call__

    def launch_tracked(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()  # the launch restored the modules

    def helper_call(self, *args, **kwargs):
        if not langs(self.fn) <= patched:
            patch_lang_tracked(self.fn)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    interp._patch_lang = patch_lang_tracked  # GridExecutor.__call__ looks it up at each launch
    grid_executor.__call__ = launch_tracked
    function.__call__ = helper_call
    return True

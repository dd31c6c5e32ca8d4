"""The Triton kernels for CUDA (and Triton's CPU interpreter in tests): :mod:`.attention` (the calls, their limits and
checks) over :mod:`.programs` (the ``@triton.jit`` programs, imported only where Triton is installed)."""

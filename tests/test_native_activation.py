"""The native step's MLP activation (silu(gate) * up, eight floats at a time) against float64."""

from __future__ import annotations

import ctypes

import pytest
import torch

from sparsedecode.kernels import cpu

pytestmark = pytest.mark.skipif(cpu.library() is None, reason="the C kernel does not build here")


def _silu_times(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    library = cpu.library()
    function = library.silu_times_f32
    function.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    function.restype = ctypes.c_int
    out = gate.clone()
    assert function(out.data_ptr(), up.data_ptr(), out.numel()) == 0
    return out


@pytest.mark.parametrize("n", [1000, 7, 8, 17])  # tails of 0, 7, 0 and 1 elements after the groups of 8
def test_silu_times_matches_float64(n):
    """Within 4e-7 of float64's silu(x) * u relative where that exceeds 1e-37, under 1e-35 in magnitude below
    -87 (where the true value is ~1e-36), exactly 0 at 0, and the formula's special values: inf -> inf, -inf and
    NaN -> NaN, -0 -> -0. Every element, the tail's included, is checked (a tail left alone or no clamp fails)."""
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, -0.0])
    x = torch.cat([special, torch.linspace(-90.0, 90.0, n - 5)]) if n > 8 else torch.linspace(-90.0, 90.0, n)
    up = torch.linspace(0.5, 3.0, n)
    got = _silu_times(x.contiguous(), up.contiguous()).double()
    want = (x.double() / (1.0 + torch.exp(-x.double()))) * up.double()
    below = (x < -87.0) & x.isfinite()
    normal = want.isfinite() & (want.abs() > 1e-37) & ~below
    assert float(((got - want).abs() / want.abs())[normal].max()) < 4e-7
    assert bool((got[below].abs() < 1e-35).all())
    rest = ~normal & ~below & (x == 0)
    assert bool((got[rest] == 0).all())
    if n > 8:
        assert got[0] == float("inf")
        assert bool(got[1:3].isnan().all())
        assert bool(torch.signbit(got[3:5]).all())
        assert int((normal | below | rest).sum()) == n - 3  # all but inf, -inf and NaN took a check above
    else:
        assert int((normal | below | rest).sum()) == n

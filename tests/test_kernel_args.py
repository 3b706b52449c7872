"""The named kernel arguments (dpkernels/_kernel_args.py) are the one source of every hyper list."""

import subprocess
import sys
from pathlib import Path

import pytest

from dpkernels import _kernel_args as ka

pytestmark = pytest.mark.no_cpu_kernels

ROOT = Path(__file__).resolve().parents[1]


def test_generated_headers_are_fresh():
    """csrc/include/dpkernels/kernel_args*.h equal a fresh generation from the spec."""
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_kernel_args.py"), "--check"], capture_output=True,
                         text=True)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr


def test_pack_and_unpack_by_name():
    values = {n: float(i) / 7 for i, n in enumerate(ka.ADAM.names)}
    values["variant"] = 2
    hyper = ka.ADAM.pack(**values)
    assert hyper[ka.ADAM.index("eps1")] == values["eps1"]
    assert ka.ADAM.unpack(hyper) == values
    with pytest.raises(TypeError, match=r"missing \['variant'\]"):
        ka.ADAM.pack(**{k: v for k, v in values.items() if k != "variant"})
    with pytest.raises(TypeError, match=r"unknown \['lr2'\]"):
        ka.ADAM.pack(**values, lr2=1.0)
    with pytest.raises(ValueError, match=r"hyper\[14\] must be one of"):
        ka.ADAM.unpack([*hyper[:-1], 3.0])


def test_filter_layout():
    co = dict(a=1.0, g=0.5, c=[1, 2], d=[3, 4], e=[5, 6], f=[7, 8])
    packed = ka.FILTER.pack(**co)
    assert packed == [1.0, 0.5, 1, 2, 3, 4, 5, 6, 7, 8]
    assert ka.FILTER.split(packed) == co
    with pytest.raises(ValueError, match="2 \\+ 4K"):
        ka.FILTER.buffers(5)


def test_triton_slots_come_from_the_spec():
    pytest.importorskip("triton")
    from dpkernels.triton_kernels import optim as tk

    assert tk.A_EPS1.value == ka.ADAM.index("eps1") and tk.M_BSCALE.value == ka.MACADAM.index("bscale")
    assert tk._RECIPROCAL_SLOTS[tk.ADAM.value] == tuple(ka.ADAM.index(n) for n in ("bias1", "bias2", "bias2_prev"))
    assert tk._RECIPROCAL_SLOTS[tk.MACADAM.value] == tuple(ka.MACADAM.index(n) for n in ("bias1", "bias2", "kappa"))

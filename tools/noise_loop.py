"""Build tools/noise_loop.cpp once per CPU path with that path's flags (tools/build_config.py) and
run each on one core: the generators' cost without the op around them (docs/BENCHMARKS.md).

    .venv/bin/python tools/noise_loop.py [--core 1] [--hide-fma]

--hide-fma hides FMA and AVX2 from glibc (GLIBC_TUNABLES), as a CPU without them does: its fmaf is
then the software routine, which the portable path's generator avoids (csrc/cpu/noise_cpu.h, vfma).
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import build_config as cfg  # noqa: E402

HERE = Path(__file__).parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--core", type=int, default=1, help="the core each run is pinned to (%(default)s)")
    ap.add_argument("--hide-fma", action="store_true", help="hide FMA and AVX2 from glibc's fmaf, as such a CPU does")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for cap in cfg.CPU_CAPABILITIES:
            exe = Path(tmp) / f"noise_loop_{cap}"
            subprocess.run(cfg.program_command(HERE / "noise_loop.cpp", exe, cap), check=True)
            run = ["taskset", "-c", str(args.core), str(exe)]
            env = {**os.environ, "GLIBC_TUNABLES": cfg.GLIBC_HIDE_FMA} if args.hide_fma else None
            out = subprocess.run(run, check=True, capture_output=True, text=True, env=env)
            print(f"{cap:8s} {out.stdout.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

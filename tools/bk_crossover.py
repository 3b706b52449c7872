"""Measure where book-keeping's Gram form stops beating the tiled product (sets ``GRAM_CROSSOVER``,
and with ``--conv`` ``CONV_GRAM_CROSSOVER``).

``dpkernels.layers.linear_sumsq(method="auto")`` takes ``"gram"`` (``O(T²(d_in + d_out))`` per
sample) over ``"tiled"`` (``O(T·d_in·d_out)``) when the flop model ``x = T·(d_in + d_out) / (d_in·d_out)``
(gram flops ÷ tiled flops) is at most the backend's ``GRAM_CROSSOVER`` (dpkernels/layers.py). This script times
both methods on one backend (``cpu`` by default; fp32, ``B = 32``, no scale, no shift) over a grid of
``T`` and ``(d_in, d_out)``, prints per point the two medians, their ratio and ``x``, and the value of
``GRAM_CROSSOVER`` that would have cost the least over the grid (sum of each point's time with the
chosen method ÷ the better one's).

Timing: the ``dpkernels bench`` machinery (:func:`dpkernels.bench._timing.time_round_robin`: shuffled
rounds, cache flushed before every call, garbage collector off, medians), one grid point at a time.
Run it on an otherwise idle machine: the "other cores" column says how busy the rest of it was.

    .venv/bin/python tools/bk_crossover.py                       # the full grid (minutes)
    .venv/bin/python tools/bk_crossover.py --T 2,16 --d 64 --pairs 256x1024 --repeats 3
    .venv/bin/python tools/bk_crossover.py --conv                # 3x3 convs, padding 1

``--conv``: 3×3 convolutions (padding 1, ``C_in = C_out = d`` over ``--d``, ``H = W`` over ``--hw``,
so ``T = H²`` and ``d_in = 9·C_in``) through :func:`dpkernels.layers.conv2d_sumsq`: there the tiled
product reads the patches in place while the Gram form builds them, so the crossover is lower.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import torch

from dpkernels import layers
from dpkernels.bench._timing import Provider, time_round_robin

T_GRID = (2, 4, 8, 16, 32, 64, 128, 256)
D_GRID = (64, 256, 1024)
PAIRS = ((256, 1024), (1024, 64))  # d_in != d_out
CONV_D_GRID = (32, 64, 128, 256)  # --conv: channels C_in = C_out
HW_GRID = (2, 4, 8, 16)  # --conv: image sizes


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for item in filter(None, (v.strip() for v in text.split(","))):
        d_in, d_out = item.lower().split("x")
        out.append((int(d_in), int(d_out)))
    return out


def flop_model(T: int, d_in: int, d_out: int) -> float:
    """Gram flops ÷ tiled flops per sample: ``T·(d_in + d_out) / (d_in·d_out)``."""
    return T * (d_in + d_out) / (d_in * d_out)


def tiled_missing(backend: str) -> str | None:
    from dpkernels.bench.layers import tiled_missing as why

    return why(backend)


def _operands(B: int, T: int, d_in: int, d_out: int, args):
    """``norms(method)`` for one grid point: a linear layer ``[B, T, d]``, or with ``--conv`` a 3×3
    conv with ``C_in = d_in / 9`` channels on an ``H × H`` image, ``T = H²``."""
    gen = torch.Generator().manual_seed(0)
    if not args.conv:
        a = torch.randn(B, T, d_in, generator=gen).to(args.device)
        g = torch.randn(B, T, d_out, generator=gen).to(args.device)
        return lambda m: layers.linear_sumsq(a, g, method=m, backend=args.backend)
    H = math.isqrt(T)
    x = torch.randn(B, d_in // 9, H, H, generator=gen).to(args.device)
    g = torch.randn(B, d_out, H, H, generator=gen).to(args.device)
    shape = (d_out, d_in // 9, 3, 3)
    return lambda m: layers.conv2d_sumsq(x, g, shape, padding=1, method=m, backend=args.backend)


def measure(B: int, T: int, d_in: int, d_out: int, args) -> dict:
    norms = _operands(B, T, d_in, d_out, args)
    providers = [
        Provider(m, "dpkernels", call=lambda m=m: norms(m), skip=args.tiled_skip if m == "tiled" else None)
        for m in ("gram", "tiled")
    ]
    res = time_round_robin(providers, args.repeats, args.warmup, args.budget, device=args.device)
    other = res.pop("_other_cpu_cores")
    med = {m: statistics.median(r["times_s"]) for m, r in res.items() if r["times_s"]}
    if "gram" in med and "tiled" in med:  # the two agree (a sanity check on the kernels timed)
        sg, st = norms("gram"), norms("tiled")
        rel = float((sg - st).abs().max() / st.abs().max())
    else:
        rel = None
    return {
        "B": B, "T": T, "d_in": d_in, "d_out": d_out, "flop_model": flop_model(T, d_in, d_out),
        "gram_s": med.get("gram"), "tiled_s": med.get("tiled"),
        "gram_over_tiled": med["gram"] / med["tiled"] if len(med) == 2 else None,
        "auto_picks": _auto_picks(T, d_in, d_out, args.conv, args.backend),
        "gram_vs_tiled_rel_diff": rel, "other_cpu_cores": other,
    }  # fmt: skip


def _auto_picks(T: int, d_in: int, d_out: int, conv: bool, backend: str) -> str:
    if conv:
        return "gram" if flop_model(T, d_in, d_out) <= layers.CONV_GRAM_CROSSOVER else "tiled"
    return layers._pick_method("auto", T, d_out, d_in, False, backend)


def best_crossover(rows: list[dict]) -> tuple[float, float, float] | None:
    """``(low, high, cost)``: every ``GRAM_CROSSOVER`` in ``[low, high)`` gives the least total
    ``Σ time(chosen) / time(best) − 1`` over the measured points (None without both times)."""
    pts = sorted((r["flop_model"], r["gram_s"], r["tiled_s"]) for r in rows if r["gram_over_tiled"] is not None)
    if not pts:
        return None
    xs = sorted({x for x, _, _ in pts})
    cands = [0.0] + xs  # C = xs[k]: gram for every x <= xs[k]
    best = None
    for i, c in enumerate(cands):
        cost = sum((gs if x <= c else ts) / min(gs, ts) - 1.0 for x, gs, ts in pts)
        hi = xs[i] if i < len(xs) else math.inf  # the next measured x: the choice changes there
        if best is None or cost < best[2] - 1e-12:
            best = (c, hi, cost)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--B", type=int, default=32)
    p.add_argument("--T", type=_ints, default=list(T_GRID), help="(default %(default)s)")
    p.add_argument("--d", type=_ints, default=list(D_GRID), help="square layers d_in = d_out (default %(default)s)")
    p.add_argument("--pairs", type=_pairs, default=list(PAIRS), help="d_inxd_out,... (default 256x1024,1024x64)")
    p.add_argument("--conv", action="store_true", help="3x3 convs (padding 1) instead of linear layers")
    p.add_argument("--hw", type=_ints, default=list(HW_GRID), help="--conv: image sizes H = W (default %(default)s)")
    p.add_argument("--backend", default="cpu", help="dpkernels backend (default %(default)s)")
    p.add_argument("--device", default=None, help="tensor device (default: cuda for cuda/triton, else cpu)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--budget", type=float, default=5.0, help="seconds per method and point (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: leave as is)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows here")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if args.backend in ("cuda", "triton") else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.tiled_skip = tiled_missing(args.backend)
    if args.tiled_skip:
        print(f"tiled not timed: {args.tiled_skip}", file=sys.stderr)

    if args.conv:
        dims = [(9 * d, d) for d in (args.d if args.d != list(D_GRID) else CONV_D_GRID)]
        args.T = [h * h for h in args.hw]
        name, current = "CONV_GRAM_CROSSOVER", layers.CONV_GRAM_CROSSOVER
    else:
        dims = [(d, d) for d in args.d] + list(args.pairs)
        name = f"GRAM_CROSSOVER[{args.backend!r}]"
        current = layers.GRAM_CROSSOVER.get(args.backend, layers.GRAM_CROSSOVER_DEFAULT)
    print(f"backend {args.backend} on {args.device}, B={args.B}, fp32, {torch.get_num_threads()} threads; "
          f"current {name} = {current}")  # fmt: skip
    head = f"{'T':>4} {'d_in':>5} {'d_out':>5} {'flop model':>10} {'gram ms':>9} {'tiled ms':>9} {'gram/tiled':>10}"
    print(head + f" {'faster':>6} {'auto now':>8} {'other cores':>11}")
    rows = []
    for d_in, d_out in dims:
        for T in args.T:
            r = measure(args.B, T, d_in, d_out, args)
            rows.append(r)
            ms = lambda s: "—" if s is None else f"{1e3 * s:.3f}"  # noqa: E731
            ratio = r["gram_over_tiled"]
            faster = "—" if ratio is None else ("gram" if ratio < 1 else "tiled")
            print(f"{T:>4} {d_in:>5} {d_out:>5} {r['flop_model']:>10.4f} {ms(r['gram_s']):>9} {ms(r['tiled_s']):>9} "
                  f"{'—' if ratio is None else f'{ratio:.3f}':>10} {faster:>6} {r['auto_picks']:>8} "
                  f"{r['other_cpu_cores']:>11.2f}", flush=True)  # fmt: skip
    best = best_crossover(rows)
    if best is None:
        print("no point has both times: no GRAM_CROSSOVER suggestion")
    else:
        lo, hi, cost = best
        print(f"least total slowdown over the grid ({cost:.3f}, summed time/best - 1): {name} in "
              f"[{lo:.4g}, {hi:.4g}) (gram where flop model <= it)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": args.backend, "device": args.device, "threads": torch.get_num_threads(),
                       "conv": args.conv, "rows": rows, "suggested_crossover": best}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

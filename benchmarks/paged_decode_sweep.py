"""Launch parameters of the Triton paged MLA decode kernel (:func:`pallas_kernels.paged_latent_attention.
paged_attention_triton`) on ``benchmarks/paged_decode.py``'s attention case (k3-slice widths: 96 heads, C 512, Dr 64,
16-token pages, its 16 rows of 1,024 to 32,768 positions), beside the gather reference and the ``xla`` form.

    python benchmarks/paged_decode_sweep.py [--seconds 150] [--old OLD.py]

One JSON line per case: ``ms``, ``roofline_fraction`` (the latents the step must read over the copy bandwidth
measured in the same process), ``err`` (max |difference| from the gather reference). ``--old``: a file holding an
earlier version of the module (``git show REV:pallas_kernels/paged_latent_attention.py > OLD.py``), whose
``paged_attention_triton`` is timed with its defaults first and last (``old_triton``). The sweep stops starting
cases after ``--seconds``.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=150.0)
    ap.add_argument("--old", default="")
    args = ap.parse_args()

    import jax
    import numpy as np

    from benchmarks.decode import copy_bandwidth_gbps
    from benchmarks.paged_decode import LENGTHS, attention_inputs, timed
    from pallas_kernels import paged_latent_attention as pla

    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("paged_latent_attention_old", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    lengths = [int(x) for x in LENGTHS.split(",")]
    c, dr = 512, 64
    operands = attention_inputs(lengths, 96, c, dr, 16, 128)
    scale = 192 ** -0.5
    gather = jax.jit(lambda *a: pla.paged_attention_reference(*a, scale))
    want = np.asarray(gather(*operands), np.float32)
    nbytes = sum(n + 1 for n in lengths) * (c + dr) * 2
    gbps = copy_bandwidth_gbps()
    roof = nbytes / (gbps * 1e9) * 1e3
    print(json.dumps({"bytes": nbytes, "copy_gbps": round(gbps, 1), "roofline_ms": round(roof, 4),
                      "max_abs": float(np.abs(want).max()), "device": jax.devices()[0].device_kind}), flush=True)

    def case(label: dict, fn) -> None:
        try:
            got = np.asarray(jax.block_until_ready(fn(*operands)), np.float32)
            ms = timed(lambda: fn(*operands), 20)
            rec = {**label, "ms": round(ms, 4), "roofline_fraction": round(roof / ms, 4),
                   "err": float(np.max(np.abs(got - want)))}
        except Exception as e:  # noqa: BLE001 - a sweep: report the case and go on
            rec = {**label, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps(rec), flush=True)

    if old is not None:
        case({"impl": "old_triton"}, jax.jit(lambda *a: old.paged_attention_triton(*a, scale)))
    case({"impl": "gather"}, gather)
    case({"impl": "xla"}, jax.jit(lambda *a: pla.paged_attention_xla(*a, scale)))
    case({"impl": "triton_defaults"}, jax.jit(lambda *a: pla.paged_attention_triton(*a, scale)))
    end = time.time() + args.seconds
    for step, splits, warps, stages in itertools.product((64, 32, 16), (16, 64), (8, 4), (3, 2)):
        if time.time() > end:
            break
        case({"step": step, "splits": splits, "warps": warps, "stages": stages},
             jax.jit(lambda *a, p=(splits, step, warps, stages): pla.paged_attention_triton(
                 *a, scale, splits=p[0], step=p[1], num_warps=p[2], num_stages=p[3])))
    if old is not None:
        case({"impl": "old_triton_again"}, jax.jit(lambda *a: old.paged_attention_triton(*a, scale)))


if __name__ == "__main__":
    main()

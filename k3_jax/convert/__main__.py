"""``python -m k3_jax.convert`` — verify / convert / export / fixture.

verify  DIR_OR_INDEX [--config CONFIG]     check names, shards, headers, sizes; one summary line; rc 1 on error
convert HF_DIR OUT [--experts bf16|mxfp4]  HF safetensors -> orbax OCDBT params (streamed, atomic)
export  ORBAX_DIR OUT [--experts …] [--source-dir HF_DIR]   orbax params -> released HF layout
fixture OUT [--config k3-tiny] [--experts mxfp4]            random model in the released format
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m k3_jax.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify")
    v.add_argument("path")
    v.add_argument("--config", default=None, help="config.json (default: DIR/config.json)")
    c = sub.add_parser("convert")
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--experts", choices=["bf16", "mxfp4"], default=None)
    c.add_argument("--overwrite", action="store_true")
    e = sub.add_parser("export")
    e.add_argument("orbax_dir")
    e.add_argument("out")
    e.add_argument("--experts", choices=["bf16", "mxfp4"], default=None)
    e.add_argument("--source-dir", default=None, help="HF dir to copy tokenizer files / vision config from")
    e.add_argument("--max-shard-gb", type=float, default=5.0)
    e.add_argument("--overwrite", action="store_true")
    f = sub.add_parser("fixture")
    f.add_argument("out")
    f.add_argument("--config", default="k3-tiny")
    f.add_argument("--experts", choices=["bf16", "mxfp4"], default="mxfp4")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from k3_jax.convert.hf import CheckpointError
    from k3_jax.convert.safetensors_io import SafetensorsError

    try:
        if a.cmd == "verify":
            from k3_jax.convert.hf import verify

            rep = verify(a.path, a.config)
            for msg in rep.errors:
                print("error:", msg, file=sys.stderr)
            print(rep.summary())
            return 0 if rep.ok else 1
        if a.cmd == "convert":
            from k3_jax.convert.orbax_io import convert_to_orbax

            st = convert_to_orbax(a.hf_dir, a.out, experts=a.experts, overwrite=a.overwrite)
            gb = (st["bytes_read"] or 0) / 1e9
            print(
                json.dumps(
                    {
                        "out": os.path.abspath(a.out),
                        "arrays": st["tensors"],
                        "gb_read": round(gb, 3),
                        "seconds": round(st["seconds"], 2),
                        "gb_per_s": round(gb / st["seconds"], 3),
                    }
                )
            )
            return 0
        if a.cmd == "export":
            from k3_jax.config import config_from_dict
            from k3_jax.convert.hf import save_checkpoint
            from k3_jax.convert.orbax_io import restore_params

            with open(os.path.join(a.orbax_dir, "k3_config.json")) as fh:
                cfg = config_from_dict(json.load(fh))
            params = restore_params(a.orbax_dir)
            save_checkpoint(
                cfg,
                params,
                a.out,
                experts=a.experts,
                source_dir=a.source_dir,
                max_shard_bytes=int(a.max_shard_gb * (1 << 30)),
                overwrite=a.overwrite,
            )
            print(json.dumps({"out": os.path.abspath(a.out)}))
            return 0
        if a.cmd == "fixture":
            from k3_jax.convert.fixture import write_fixture

            write_fixture(a.out, a.config, experts=a.experts, seed=a.seed, overwrite=a.overwrite)
            print(json.dumps({"out": os.path.abspath(a.out)}))
            return 0
    except (CheckpointError, SafetensorsError, FileExistsError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""``python -m k3_jax.convert`` — verify / convert / export / fixture.

verify  DIR_OR_INDEX [--config CONFIG]     check names, shards, headers, sizes; one summary line
convert HF_DIR OUT [--experts bf16|mxfp4]  HF safetensors -> orbax OCDBT params (streamed, atomic)
export  ORBAX_DIR OUT [--experts …] [--source-dir HF_DIR]   orbax params -> released HF layout
fixture OUT [--config k3-tiny] [--experts mxfp4]            random model in the released format

Every command takes ``--quiet`` (no progress output). Progress goes to stderr: a bar on a terminal, plain
``JOB: key=value …`` lines otherwise (see :mod:`k3_jax.progress`); results are one JSON line on stdout.
Exit codes: 0 done; 1 ``verify`` ran and found problems (listed as ``error:`` lines); 2 the command could not
do its job (unreadable or bad input, unwritable or existing output, …): one ``error: …`` line naming the
file or directory. The output path is checked before any input is read, and leftovers of killed runs next to
it (``OUT.partial-PID``) are removed when their process is gone (:mod:`k3_jax.convert.outdir`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--quiet", action="store_true", help="no progress bar / progress lines")
    ap = argparse.ArgumentParser(
        prog="python -m k3_jax.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", parents=[common])
    v.add_argument("path")
    v.add_argument("--config", default=None, help="config.json (default: DIR/config.json)")
    c = sub.add_parser("convert", parents=[common])
    c.add_argument("hf_dir")
    c.add_argument("out")
    c.add_argument("--experts", choices=["bf16", "mxfp4"], default=None)
    c.add_argument("--overwrite", action="store_true")
    e = sub.add_parser("export", parents=[common])
    e.add_argument("orbax_dir")
    e.add_argument("out")
    e.add_argument("--experts", choices=["bf16", "mxfp4"], default=None)
    e.add_argument("--source-dir", default=None, help="HF dir to copy tokenizer files / vision config from")
    e.add_argument("--max-shard-gb", type=float, default=5.0)
    e.add_argument("--overwrite", action="store_true")
    f = sub.add_parser("fixture", parents=[common])
    f.add_argument("out")
    f.add_argument("--config", default="k3-tiny")
    f.add_argument("--experts", choices=["bf16", "mxfp4"], default="mxfp4")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--overwrite", action="store_true")
    return ap


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at emit time (so a test's capture sees it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _message(exc: BaseException) -> str:
    """One readable line for a user-facing failure (OS errors name their path)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def _read_orbax_config(orbax_dir: str):
    from k3_jax.config import config_from_dict
    from k3_jax.convert.hf import CheckpointError

    if not os.path.isdir(orbax_dir):
        raise CheckpointError(f"{orbax_dir}: not a directory (expected the output of "
                              "`python -m k3_jax.convert convert`)")
    path = os.path.join(orbax_dir, "k3_config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: {orbax_dir} is not a directory written by "
                              "`python -m k3_jax.convert convert`")
    try:
        with open(path) as fh:
            return config_from_dict(json.load(fh))
    except (json.JSONDecodeError, ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path}: not a valid k3 config ({type(e).__name__}: {e})") from None


def _run(a: argparse.Namespace) -> int:
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
        from k3_jax.convert.hf import read_raw_config, save_checkpoint
        from k3_jax.convert.orbax_io import restore_params
        from k3_jax.convert.outdir import check_output

        cfg = _read_orbax_config(a.orbax_dir)  # every check before the (large) restore
        check_output(a.out, a.overwrite)
        if a.source_dir is not None:
            read_raw_config(a.source_dir)
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
    from k3_jax.convert.fixture import write_fixture

    write_fixture(a.out, a.config, experts=a.experts, seed=a.seed, overwrite=a.overwrite)
    print(json.dumps({"out": os.path.abspath(a.out)}))
    return 0


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    log = logging.getLogger("k3_jax")  # ours only: the libraries' INFO chatter stays off
    if not any(isinstance(h, _StderrHandler) for h in log.handlers):
        h = _StderrHandler()
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
    from k3_jax import progress
    from k3_jax.convert.hf import CheckpointError
    from k3_jax.convert.safetensors_io import SafetensorsError

    was_quiet = progress.is_quiet()
    progress.set_quiet(a.quiet or was_quiet)
    try:
        return _run(a)
    except (CheckpointError, SafetensorsError, OSError, ValueError) as exc:
        first, *rest = _message(exc).splitlines() or [type(exc).__name__]
        print(f"error: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line.strip()}", file=sys.stderr)
        return 2
    finally:
        progress.set_quiet(was_quiet)  # main() called in-process leaves the setting as it found it


if __name__ == "__main__":
    sys.exit(main())

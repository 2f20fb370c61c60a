"""Converter benchmark: stream a >= 4 GiB synthetic K3-shaped checkpoint to orbax; peak RSS and GB/s.

Peer (same run, same files): the safetensors library's ``safetensors.flax.load_file`` of every shard
(whole-file reads into JAX arrays, the usual HF -> JAX path). Each phase runs in its own process and
reports its own peak RSS (``ru_maxrss``); the shard files are evicted from the page cache
(``posix_fadvise DONTNEED``) before each read phase so both read from disk. Prints one JSON line.

    python benchmarks/convert.py [--gib 4.2] [--workdir /tmp/k3_convert_bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def bench_config(experts: int):
    """K3-shaped (every feature, 10 layers like the tiny plan) but wide enough for GiB-scale tensors."""
    from k3_jax.config import config_path, load_config

    cfg = load_config(config_path("k3-tiny"))
    return cfg.replace(
        vocab_size=32768, hidden_size=2048, num_attention_heads=16, q_lora_rank=512, kv_lora_rank=256,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kda_num_heads=16, kda_head_dim=128,
        intermediate_size=8192, num_experts=experts, num_experts_per_token=8, moe_intermediate_size=1024,
        routed_expert_hidden_size=1024, expert_format="bf16",
    )  # fmt: skip


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB -> GiB


def _evict(d: str) -> None:
    for f in os.listdir(d):
        p = os.path.join(d, f)
        if os.path.isfile(p):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def phase_fixture(work: str, experts: int) -> dict:
    from k3_jax.convert.fixture import write_fixture

    t = time.perf_counter()
    write_fixture(
        os.path.join(work, "hf"), bench_config(experts), experts="bf16", max_shard_bytes=1 << 30, overwrite=True
    )
    return {"seconds": time.perf_counter() - t}


def phase_convert(work: str) -> dict:
    from k3_jax.convert.hf import read_index
    from k3_jax.convert.orbax_io import convert_to_orbax

    hf = os.path.join(work, "hf")
    _evict(hf)
    t = time.perf_counter()
    st = convert_to_orbax(hf, os.path.join(work, "orbax"), overwrite=True)
    dt = time.perf_counter() - t
    total = read_index(hf).total_size
    return {"seconds": dt, "gb_per_s": total / 1e9 / dt, "peak_rss_gib": _peak_rss_gib(), "arrays": st["tensors"]}


def phase_peer(work: str) -> dict:
    from safetensors.flax import load_file

    hf = os.path.join(work, "hf")
    _evict(hf)
    t = time.perf_counter()
    out = {}
    total = 0
    for f in sorted(os.listdir(hf)):
        if f.endswith(".safetensors"):
            d = load_file(os.path.join(hf, f))
            total += sum(v.nbytes for v in d.values())  # jax CPU arrays
            out.update(d)
    dt = time.perf_counter() - t
    return {"seconds": dt, "gb_per_s": total / 1e9 / dt, "peak_rss_gib": _peak_rss_gib()}


def _run(phase: str, work: str, experts: int) -> dict:
    r = subprocess.run(
        [sys.executable, __file__, "--phase", phase, "--workdir", work, "--experts", str(experts)],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    if r.returncode != 0:
        raise RuntimeError(f"phase {phase} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.2)
    ap.add_argument("--workdir", default="/tmp/k3_convert_bench")
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--phase", default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="reuse an existing synthetic checkpoint in --workdir")
    a = ap.parse_args()
    if a.phase:
        fn = {
            "fixture": lambda: phase_fixture(a.workdir, a.experts),
            "convert": lambda: phase_convert(a.workdir),
            "peer": lambda: phase_peer(a.workdir),
        }[a.phase]
        print(json.dumps(fn()))
        return

    from k3_jax.convert import names as N
    from k3_jax.convert.hf import _expected_sizes

    experts = 16
    while True:  # smallest expert count giving >= --gib
        cfg = bench_config(experts)
        sizes = _expected_sizes(cfg, "bf16")
        total = sum(sizes.values())
        if total >= a.gib * (1 << 30):
            break
        experts += 16
    per_layer = max(
        sum(v for k, v in sizes.items() if f".layers.{layer}." in k) for layer in range(cfg.num_hidden_layers)
    )
    largest_tensor = max(sizes.values())
    del N
    os.makedirs(a.workdir, exist_ok=True)
    have = os.path.exists(os.path.join(a.workdir, "hf", "model.safetensors.index.json"))
    fx = {"seconds": None} if (a.reuse and have) else _run("fixture", a.workdir, experts)
    conv = _run("convert", a.workdir, experts)
    peer = _run("peer", a.workdir, experts)
    orbax_bytes = sum(
        os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(a.workdir, "orbax")) for f in fs
    )
    print(json.dumps({
        "benchmark": "convert_hf_to_orbax", "checkpoint_gib": round(total / (1 << 30), 3), "experts": experts,
        "layers": cfg.num_hidden_layers, "largest_layer_gib": round(per_layer / (1 << 30), 3),
        "largest_tensor_gib": round(largest_tensor / (1 << 30), 3),
        "rss_bound_gib": round(per_layer / (1 << 30) + 1, 3),
        "ours": {k: round(v, 3) if isinstance(v, float) else v for k, v in conv.items()},
        "peer_safetensors_flax_load_file": {k: round(v, 3) for k, v in peer.items()},
        "fixture_write_s": fx["seconds"] and round(fx["seconds"], 1), "orbax_gib": round(orbax_bytes / (1 << 30), 3),
    }))  # fmt: skip
    if not a.keep:
        shutil.rmtree(a.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Vision encoder throughput: k3-jax's MoonViT3d + projector vs the release's PyTorch tower, same weights and inputs.

Encodes packed batches at the release config (27 blocks, 1024 wide, 12 heads x 128, bf16) and prints one JSON line
per case: ``{"case", "images", "patches", "tokens", "ours": {"ms", "patches_per_s", "images_per_s",
"peak_gib", "attention"}, "peer": {...} | null, "speedup", "max_rel_err"}``. Cases:

- ``1024``: ``--batch`` images of 1024x1024 (74x74 patches each after the processor's padding);
- ``mixed``: photos / screenshots / thumbnails of mixed sizes packed together;
- ``max``: one image at the release's largest budget (65536 patches, 3584x3584) — peak memory;
- ``smoke`` (only when asked for): an image and a 2-frame video of a few patches, to check the peer's wiring.

The peer (``--release-dir DIR`` with the release's ``modeling_kimi_k3.py`` + ``configuration_kimi_k3.py``,
imported at run time as in ``tests/fixtures/make_vision_golden.py``) runs in a subprocess under
``--peer-python`` (an interpreter with a CUDA torch and transformers 4.56; default: this one) on
``--peer-device``, with flash-attn when installed (the release's ``flash_attention_2`` path), else its ``eager``
path. Without ``--release-dir`` only our numbers are printed (``"peer": null``).

    python benchmarks/vision.py                                   # ours only
    python benchmarks/vision.py --release-dir /path/to/Kimi-K3 --peer-python /path/to/torch/bin/python
    python benchmarks/vision.py --cases 1024 --batch 4 --iters 5  # quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402  (jax / torch are imported where used: the peer worker runs without jax)

MIXED = [(1920, 1080), (1280, 720), (1024, 768), (640, 480), (512, 512), (2048, 1536), (300, 200), (800, 1200)]


def grids_for(sizes: list[tuple[int, int]]) -> np.ndarray:
    """Patch grids the release processor gives images of these (width, height)."""
    from k3_jax.vision.processor import MediaProcConfig, resize_plan  # noqa: PLC0415

    out = []
    for w, h in sizes:
        gh, gw = resize_plan(w, h, MediaProcConfig()).grid_hw
        out.append((1, gh // 14, gw // 14))
    return np.array(out, np.int64)


def cases(batch: int) -> dict[str, np.ndarray]:
    return {"1024": grids_for([(1024, 1024)] * batch), "mixed": grids_for(MIXED),
            "max": np.array([[1, 256, 256]], np.int64),
            "smoke": np.array([[1, 4, 6], [2, 4, 4]], np.int64)}  # tiny: checks the peer wiring, not speed


def _time(fn, iters: int) -> float:
    import jax  # noqa: PLC0415

    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters * 1e3


def run_ours(cfg, params, pixels: np.ndarray, grid: np.ndarray, iters: int) -> tuple[dict, np.ndarray]:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from k3_jax.vision.attention import attention_choice  # noqa: PLC0415
    from k3_jax.vision.plan import build_plan  # noqa: PLC0415
    from k3_jax.vision.tower import MediaEncoder  # noqa: PLC0415

    plan = build_plan(grid, cfg.vision)
    model = MediaEncoder(cfg)
    fwd = jax.jit(model.apply)
    px = jnp.asarray(pixels, jnp.bfloat16)
    arrays = jax.tree_util.tree_map(jnp.asarray, plan.arrays())
    variables = {"params": params}
    out = np.asarray(fwd(variables, px, arrays), np.float32)
    ms = _time(lambda: fwd(variables, px, arrays), iters)
    stats = jax.devices()[0].memory_stats() or {}
    impl, why = attention_choice(cfg.vision.attention, jnp.bfloat16, plan.kv_start.shape[0] * plan.q_offsets.shape[0],
                                 plan.kv_offsets.shape[0])
    return {"ms": round(ms, 3), "patches_per_s": round(pixels.shape[0] / ms * 1e3),
            "images_per_s": round(grid.shape[0] / ms * 1e3, 2),
            "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2**30, 3), "attention": f"{impl} ({why})"}, out


def run_peer(args: argparse.Namespace, vcfg_raw: dict, hf: dict[str, np.ndarray], pixels: np.ndarray,
             grid: np.ndarray) -> tuple[dict, np.ndarray | None]:
    """The release's PyTorch tower in a subprocess (``--peer-python``: an interpreter with torch + transformers)."""
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        bits = {f"w/{k}": np.asarray(v).view(np.uint16) for k, v in hf.items()}  # bf16 bit patterns
        np.savez(os.path.join(tmp, "in.npz"), pixels=pixels, grid=grid, **bits)
        with open(os.path.join(tmp, "cfg.json"), "w") as f:
            json.dump(vcfg_raw, f)
        cmd = [args.peer_python, __file__, "--peer-worker", tmp, "--release-dir", str(args.release_dir),
               "--iters", str(args.iters), "--peer-device", args.peer_device]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:  # e.g. the eager path out of memory at the largest input: say so, keep going
            return {"error": res.stderr.strip().splitlines()[-1][:300] if res.stderr.strip() else
                    f"exit {res.returncode}"}, None
        with open(os.path.join(tmp, "out.json")) as f:
            stats = json.load(f)
        return stats, np.load(os.path.join(tmp, "out.npy"))


def peer_worker(tmp: str, release_dir: Path, iters: int, device: str) -> None:
    """Run the release tower (bf16, ``device``) on the inputs in ``tmp``; write ``out.npy`` and ``out.json``."""
    import torch  # noqa: PLC0415

    from tests.fixtures.make_vision_golden import load_release  # noqa: PLC0415

    data = np.load(os.path.join(tmp, "in.npz"))
    with open(os.path.join(tmp, "cfg.json")) as f:
        vcfg_raw = json.load(f)
    mods = load_release(release_dir, ("configuration_kimi_k3", "modeling_kimi_k3"))
    cfgmod, mm = mods["configuration_kimi_k3"], mods["modeling_kimi_k3"]
    try:
        import flash_attn  # noqa: F401, PLC0415

        impl = "flash_attention_2"
    except ImportError:
        impl = "eager"
    vcfg = cfgmod.KimiK3VisionConfig(**{k: v for k, v in vcfg_raw.items() if not k.startswith("_")})
    dev = torch.device(device)
    tower = mm.MoonViT3dPretrainedModel(mm.VisionTowerConfig(vcfg))
    for block in tower.encoder.blocks:  # transformers rewrites the config's attention choice
        block.attn_implementation = impl
    proj = mm.PatchMergerMLPV2(mm.ProjectorConfig(vcfg))
    with torch.no_grad():
        for prefix, mod in (("vision_tower", tower), ("mm_projector", proj)):
            for name, p in mod.named_parameters():
                bits = data[f"w/{prefix}.{name}"].astype(np.uint32) << 16
                p.copy_(torch.from_numpy(bits.view(np.float32)))
    tower, proj = tower.to(dev, torch.bfloat16).eval(), proj.to(dev, torch.bfloat16).eval()
    px = torch.from_numpy(data["pixels"]).to(dev, torch.bfloat16)
    g = torch.from_numpy(data["grid"]).to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def fwd():
        with torch.no_grad():
            return torch.cat(list(proj(tower(px, g))))

    out = fwd().float().cpu().numpy()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fwd()
    sync()
    ms = (time.perf_counter() - t0) / iters * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0.0
    n, m = data["pixels"].shape[0], data["grid"].shape[0]
    stats = {"ms": round(ms, 3), "patches_per_s": round(n / ms * 1e3), "images_per_s": round(m / ms * 1e3, 2),
             "peak_gib": round(peak, 3), "attention": impl, "torch": torch.__version__}
    np.save(os.path.join(tmp, "out.npy"), out)
    with open(os.path.join(tmp, "out.json"), "w") as f:
        json.dump(stats, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--release-dir", type=Path, default=None)
    ap.add_argument("--cases", default="1024,mixed,max")
    ap.add_argument("--batch", type=int, default=8, help="images in the 1024x1024 case")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"])
    ap.add_argument("--layers", type=int, default=None, help="override vt_num_hidden_layers (quick checks)")
    ap.add_argument("--peer-python", default=sys.executable, help="interpreter with torch + transformers 4.56")
    ap.add_argument("--peer-device", default="cuda")
    ap.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.peer_worker:
        return peer_worker(args.peer_worker, args.release_dir, args.iters, args.peer_device)
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from k3_jax.config import load_config  # noqa: PLC0415
    from k3_jax.convert.fixture import random_vision_params  # noqa: PLC0415
    from k3_jax.convert.vision import vision_params_to_hf  # noqa: PLC0415

    raw = json.loads((REPO / "configs" / "k3.json").read_text())["vision_config"]
    cfg = load_config(REPO / "configs" / "k3.json", dtype="bfloat16", param_dtype="bfloat16")
    layers = {"vt_num_hidden_layers": args.layers} if args.layers else {}
    cfg = cfg.replace(vision=dataclasses.replace(cfg.vision, attention=args.attention, **layers))
    raw = {**raw, **layers}
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.bfloat16), random_vision_params(cfg.vision))
    hf = dict(vision_params_to_hf(jax.tree_util.tree_map(np.asarray, params), cfg.vision)) if args.release_dir else {}
    rng = np.random.default_rng(0)
    for name, grid in cases(args.batch).items():
        if name not in args.cases.split(","):
            continue
        n = int(np.prod(grid, axis=1).sum())
        pixels = rng.uniform(-1, 1, (n, 3, 14, 14)).astype(np.float32)
        ours, out = run_ours(cfg, params, pixels, grid, args.iters)
        rec = {"case": name, "images": int(grid.shape[0]), "patches": n, "tokens": int(out.shape[0]), "ours": ours,
               "peer": None, "speedup": None, "max_rel_err": None, "device": str(jax.devices()[0].device_kind)}
        if args.release_dir:
            peer, ref = run_peer(args, raw, hf, pixels, grid)
            rec["peer"] = peer
            if ref is not None:
                rec["speedup"] = round(peer["ms"] / ours["ms"], 2)
                rec["max_rel_err"] = float(np.max(np.abs(out - ref)) / max(np.max(np.abs(ref)), 1e-30))
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()

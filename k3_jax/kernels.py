"""What a config will run: the kernel choice of every op of every layer kind, per target platform.

    python -m k3_jax.kernels --config configs/k3.json [--platform tpu] [--seq-len 8192] [--compute-capability 9.0]

:func:`explain` asks each op's registry (``pallas_kernels.kda.ops.CHUNK`` / ``DECODE``,
``pallas_kernels.kda.verify.VERIFY`` (speculative verification: a few tokens with every state),
``pallas_kernels.moe.ops.EXPERT_FFN``, ``pallas_kernels.attention.ATTENTION``,
``pallas_kernels.prefix_attention.PREFIX_ATTENTION`` (a prefill chunk against a cached prefix),
``pallas_kernels.mla_decode.DECODE`` (the one-token decode step over the latent cache),
``pallas_kernels.paged_latent_attention.PAGED_DECODE`` (the decode step over a paged latent cache), the vision tower's
``k3_jax.vision.attention.VISION_ATTENTION``) what ``cfg``'s implementation
field selects for a call of the config's shapes, without running anything: the backend, or the reason an
explicit choice cannot run, and why the backends ahead of it were passed over. At run time the same registries
make the same choice per call (logged once per op, shape and choice on the ``pallas_kernels`` logger;
``pallas_kernels.registry.selections()`` lists them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from k3_jax.config import K3Config, load_config, parse_overrides
from k3_jax.errors import ConfigError
from k3_jax.vision.attention import VISION_ATTENTION, VisionAttentionCall
from pallas_kernels import attention, mla_decode, paged_latent_attention, prefix_attention
from pallas_kernels.kda import ops as kda_ops
from pallas_kernels.kda import verify as kda_verify
from pallas_kernels.moe import ops as moe_ops
from pallas_kernels.registry import (
    PLATFORMS,
    KernelUnavailable,
    Registry,
    normalize_platform,
    target_compute_capability,
)


@dataclasses.dataclass(frozen=True)
class Choice:
    """One op of one layer kind on one platform: ``backend`` (None when the explicit choice cannot run, then
    ``error`` says why) and ``passed_over`` ``[(backend, reason)]`` ahead of it in the table."""

    layer: str
    op: str
    platform: str
    requested: str
    backend: str | None
    passed_over: tuple[tuple[str, str], ...] = ()
    error: str | None = None

    def line(self) -> str:
        got = self.backend if self.backend is not None else f"ERROR: {self.error}"
        why = "; ".join(f"{n}: {r}" for n, r in self.passed_over)
        return f"{self.platform:<4} {self.layer:<20} {self.op:<16} {self.requested:<11} -> {got}" + (
            f"  (passed over {why})" if why else "")


def _choose(layer: str, reg: Registry, requested: str, call: Any) -> Choice:
    try:
        sel = reg.select(requested, call, record=False)
    except (KernelUnavailable, ValueError) as e:  # ValueError: a name this op's registry does not have
        return Choice(layer, reg.op, call.platform, requested, None, error=str(e))
    return Choice(layer, reg.op, call.platform, requested, sel.backend, sel.passed_over)


def explain(cfg: K3Config, platform: str | None = None, *, batch: int = 1, seq_len: int = 4096,
            compute_capability: float | None = None) -> list[Choice]:
    """The kernel choices of ``cfg`` per layer kind on ``platform`` (default: ``cfg.platform`` if set, else all
    of cpu, gpu, tpu) for ``batch`` sequences of ``seq_len`` tokens (decode: one token each).

    ``compute_capability``: of the target GPU (default: the visible GPU's, unknown without one; cuDNN attention
    needs >= 9.0). Layer kinds the config does not have are left out.
    """
    if platform is not None:
        platforms = (normalize_platform(platform),)
    elif cfg.platform != "auto":
        platforms = (cfg.platform,)
    else:
        platforms = PLATFORMS
    kinds = set(cfg.layer_kinds())
    has_kda = any(m == "kda" for m, _ in kinds)
    has_mla = any(m == "mla" for m, _ in kinds)
    has_moe = any(f == "moe" for _, f in kinds)
    dt = cfg.dtype
    h, dk = cfg.kda_num_heads, cfg.kda_head_dim
    out: list[Choice] = []
    for p in platforms:
        cc = compute_capability if compute_capability is not None else target_compute_capability(p)
        if has_kda:
            chunk = kda_ops.KdaCall(p, dt, (batch, seq_len, h, dk, dk), cfg.kda_chunk_size, cfg.gate_lower_bound,
                                    compute_capability=cc)
            out.append(_choose("kda (train/prefill)", kda_ops.CHUNK, cfg.kda_implementation, chunk))
            decode = dataclasses.replace(chunk, shape=(batch, 1, h, dk, dk))
            out.append(_choose("kda (decode)", kda_ops.DECODE, cfg.kda_decode_implementation, decode))
            verify = dataclasses.replace(chunk, shape=(batch, 5, h, dk, dk))  # k + 1 = 5 verified tokens
            out.append(_choose("kda (spec. verify)", kda_verify.VERIFY, cfg.kda_verify_implementation, verify))
        if has_mla:
            call = attention.AttentionCall(p, dt, (batch, seq_len, cfg.num_attention_heads, cfg.q_head_dim,
                                                   cfg.v_head_dim), True, cc)
            out.append(_choose("mla (train/prefill)", attention.ATTENTION, cfg.mla_attention_implementation, call))
            call = prefix_attention.PrefixAttentionCall(p, dt, (batch, seq_len, cfg.num_attention_heads,
                                                                cfg.q_head_dim, cfg.v_head_dim), cc)
            out.append(_choose("mla (cached prefill)", prefix_attention.PREFIX_ATTENTION,
                               cfg.mla_prefix_attention_implementation, call))
            call = mla_decode.DecodeCall(p, dt, (batch, cfg.num_attention_heads, cfg.kv_lora_rank,
                                                 cfg.qk_rope_head_dim, seq_len))
            out.append(_choose("mla (decode)", mla_decode.DECODE, cfg.mla_decode_attention_implementation, call))
            call = paged_latent_attention.PagedDecodeCall(
                p, dt, dt, (batch, 1, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, 16,
                            -(-seq_len // 16)))
            out.append(_choose("mla (paged decode)", paged_latent_attention.PAGED_DECODE,
                               cfg.mla_paged_decode_implementation, call))
        if has_moe:
            rows = batch * seq_len * cfg.num_experts_per_token
            call = moe_ops.MoeCall(p, dt, (rows, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size),
                                   cfg.num_experts, cfg.expert_format == "mxfp4", compute_capability=cc)
            out.append(_choose("moe (routed experts)", moe_ops.EXPERT_FFN, cfg.moe_implementation, call))
        if cfg.vision is not None:  # seq_len patches of one image (window = the whole item)
            cc = compute_capability if compute_capability is not None else target_compute_capability(p)
            call = VisionAttentionCall(p, dt, seq_len, seq_len, cfg.vision.head_dim, cc)
            out.append(_choose("vision tower", VISION_ATTENTION, cfg.vision.attention, call))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/k3-tiny.json")
    ap.add_argument("--platform", choices=PLATFORMS, default=None, help="default: every platform")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--compute-capability", type=float, default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="config override")
    ap.add_argument("--json", action="store_true", help="one JSON object per choice")
    args = ap.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
    except ConfigError as e:
        ap.error(str(e))
    cfg = load_config(args.config, **overrides)
    for c in explain(cfg, args.platform, batch=args.batch, seq_len=args.seq_len,
                     compute_capability=args.compute_capability):
        print(json.dumps(dataclasses.asdict(c)) if args.json else c.line())


if __name__ == "__main__":
    main()

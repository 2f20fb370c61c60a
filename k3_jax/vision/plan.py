"""Host-side packing plan for a batch of media: everything shape-dependent the tower needs, as index arrays.

The tower's per-item work — resizing the learned 64×64 position grid to each item's (h, w), the time
embedding per frame, the 2-D RoPE positions, the never-across-items attention mask and the 2×2 / mean-over-time
merge — is expressed as gathers with indices and weights computed here in numpy from ``grid_thws``. The
compiled tower then depends only on the padded patch and token counts, not on the media sizes, so a bucketed
batch of different images compiles once.

Conventions (release ``modeling_kimi_k3.py``): media are packed in order; item ``m`` with grid ``(t, h, w)``
owns ``t*h*w`` consecutive patches in ``(frame, row, column)`` raster order, and yields ``(h/kh)*(w/kw)``
merged tokens in raster order, each the concatenation of its ``kh*kw`` sub-patches (row-major within the
kernel), averaged over the ``t`` frames.

Padding (``pad_patches_to`` / ``pad_tokens_to``): padded patches get ``segment_ids == -1`` (they attend only
to other padding), zero position weights and no time term; padded tokens gather patch 0 with weight 0 and come
out as zero rows. Padding never changes the real rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from k3_jax.vision.attention import QUERY_BLOCK, attention_windows
from k3_jax.vision.config import VisionConfig


class MediaError(ValueError):
    """Bad ``grid_thws`` / ``pixel_values`` for the tower; the message names the item and the limit."""


@dataclasses.dataclass(frozen=True)
class MediaPlan:
    """Index arrays for one packed batch of media (all numpy; pass :meth:`arrays` to the tower).

    Shapes: ``Np`` = padded patch count, ``Nt`` = padded merged-token count, ``F`` = max frames in the batch,
    ``K = kh*kw``.
    """

    grid_thws: tuple[tuple[int, int, int], ...]
    merge_kernel: tuple[int, int]
    num_patches: int  # real patches (sum t*h*w)
    num_tokens: int  # real merged tokens (sum (h/kh)(w/kw))
    segment_ids: np.ndarray  # i32 [Np]: media index, -1 = padding
    pos_index: np.ndarray  # i32 [Np, 4]: flat indices into the learned [PH*PW] grid (bilinear corners)
    pos_weight: np.ndarray  # f32 [Np, 4]: bilinear weights (0 for padding)
    frame_index: np.ndarray  # i32 [Np]: row of the sin-cos time table, -1 = no time term (t == 1, padding)
    rope_pos: np.ndarray  # i32 [Np, 2]: (row, column) of the patch in its item's grid
    merge_index: np.ndarray  # i32 [Nt, K, F]: patch index of sub-patch k of token n in frame f
    merge_weight: np.ndarray  # f32 [Nt, F]: 1/t for the item's frames, 0 otherwise / for padding
    kv_start: np.ndarray  # i32 [nb]: first key of each query block's attention window (see vision.attention)
    q_offsets: np.ndarray  # i32 [Bq]: arange(Bq), the query block (its length is the static block size)
    kv_offsets: np.ndarray  # i32 [W]: arange(W), the key window (its length is the static window size)

    @property
    def tokens_per_item(self) -> tuple[int, ...]:
        return tuple(token_counts(self.grid_thws, self.merge_kernel))

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays the tower consumes (a dict pytree; its shapes decide the compiled program)."""
        return {k: getattr(self, k) for k in ("segment_ids", "pos_index", "pos_weight", "frame_index",
                                              "rope_pos", "merge_index", "merge_weight", "kv_start", "q_offsets",
                                              "kv_offsets")}


def as_grid_thws(grid_thws: np.ndarray | Sequence[Sequence[int]]) -> tuple[tuple[int, int, int], ...]:
    """``grid_thws`` as a tuple of ``(t, h, w)`` python ints; it must be concrete (host) data."""
    try:
        g = np.asarray(grid_thws)
    except Exception as e:  # a tracer: shapes of the tower depend on these values
        raise MediaError(f"grid_thws must be concrete host data (numpy / list), not a traced value: {e}") from None
    if g.ndim != 2 or g.shape[1] != 3 or not np.issubdtype(g.dtype, np.integer):
        raise MediaError(f"grid_thws must be an int array [N_media, 3] of (t, h, w), got {g.dtype} {g.shape}")
    return tuple((int(t), int(h), int(w)) for t, h, w in g)


def token_counts(grid_thws: Sequence[tuple[int, int, int]], kernel: tuple[int, int]) -> list[int]:
    """Merged tokens per item, ``(h / kh) * (w / kw)`` (frames are averaged)."""
    kh, kw = kernel
    return [(h // kh) * (w // kw) for _, h, w in grid_thws]


def check_grid(grid_thws: Sequence[tuple[int, int, int]], cfg: VisionConfig) -> None:
    """Raise :class:`MediaError` for an item the tower cannot take (frames, RoPE extent, merge kernel)."""
    kh, kw = cfg.merge_kernel_size
    for m, (t, h, w) in enumerate(grid_thws):
        if not 1 <= t <= cfg.init_pos_emb_time:
            raise MediaError(f"media item {m}: t={t} frames, expected 1..{cfg.init_pos_emb_time} "
                             "(init_pos_emb_time; split longer videos into chunks)")
        if not (1 <= h <= cfg.rope_max_height and 1 <= w <= cfg.rope_max_width):
            raise MediaError(f"media item {m}: grid {h}x{w} patches, expected 1..{cfg.rope_max_height} x "
                             f"1..{cfg.rope_max_width} (the 2-D RoPE table)")
        if h % kh or w % kw:
            raise MediaError(f"media item {m}: grid {h}x{w} patches is not divisible by the merge kernel "
                             f"{kh}x{kw} (the processor pads images to multiples of {kh * cfg.patch_size}"
                             f"x{kw * cfg.patch_size} pixels)")


def _bilinear_1d(out_size: int, in_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``F.interpolate(mode="bilinear", align_corners=False)`` along one axis: (i0, i1, weight of i1), fp32.

    Source coordinate ``(i + 0.5) * in/out - 0.5`` clamped at 0; ``i1 = min(i0 + 1, in - 1)``.
    """
    scale = np.float32(in_size) / np.float32(out_size)
    src = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    src = np.maximum(src, np.float32(0.0))
    i0 = np.floor(src).astype(np.int32)
    i0 = np.minimum(i0, in_size - 1)
    i1 = np.minimum(i0 + 1, in_size - 1)
    lam = (src - i0.astype(np.float32)).astype(np.float32)
    return i0, i1, lam


def build_plan(grid_thws: np.ndarray | Sequence[Sequence[int]], cfg: VisionConfig, *,
               pad_patches_to: int | None = None, pad_tokens_to: int | None = None,
               attn_block: int = QUERY_BLOCK) -> MediaPlan:
    """The :class:`MediaPlan` of a packed batch (see the module docstring for layout and padding).

    ``attn_block``: query rows per attention block (the key window of each block is computed here).
    """
    grid = as_grid_thws(grid_thws)
    if not grid:
        raise MediaError("grid_thws is empty: no media to encode")
    check_grid(grid, cfg)
    kh, kw = cfg.merge_kernel_size
    ph, pw = cfg.init_pos_emb_height, cfg.init_pos_emb_width
    n_real = sum(t * h * w for t, h, w in grid)
    tokens = token_counts(grid, (kh, kw))
    t_real = sum(tokens)
    n_pad = n_real if pad_patches_to is None else pad_patches_to
    t_pad = t_real if pad_tokens_to is None else pad_tokens_to
    if n_pad < n_real:
        raise MediaError(f"pad_patches_to={pad_patches_to} < {n_real} patches in the batch")
    if t_pad < t_real:
        raise MediaError(f"pad_tokens_to={pad_tokens_to} < {t_real} merged tokens in the batch")
    frames = max(t for t, _, _ in grid)
    k = kh * kw

    seg = np.full((n_pad,), -1, np.int32)
    pos_index = np.zeros((n_pad, 4), np.int32)
    pos_weight = np.zeros((n_pad, 4), np.float32)
    frame_index = np.full((n_pad,), -1, np.int32)
    rope = np.zeros((n_pad, 2), np.int32)
    merge_index = np.zeros((t_pad, k, frames), np.int32)
    merge_weight = np.zeros((t_pad, frames), np.float32)

    p0 = n0 = 0
    for m, (t, h, w) in enumerate(grid):
        y0, y1, ly = _bilinear_1d(h, ph)
        x0, x1, lx = _bilinear_1d(w, pw)
        idx = np.stack([
            (y0[:, None] * pw + x0[None, :]), (y0[:, None] * pw + x1[None, :]),
            (y1[:, None] * pw + x0[None, :]), (y1[:, None] * pw + x1[None, :]),
        ], axis=-1).reshape(h * w, 4)
        wts = np.stack([
            (1 - ly)[:, None] * (1 - lx)[None, :], (1 - ly)[:, None] * lx[None, :],
            ly[:, None] * (1 - lx)[None, :], ly[:, None] * lx[None, :],
        ], axis=-1).reshape(h * w, 4).astype(np.float32)
        rows, cols = np.meshgrid(np.arange(h, dtype=np.int32), np.arange(w, dtype=np.int32), indexing="ij")
        hw = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=-1)
        n = t * h * w
        sl = slice(p0, p0 + n)
        seg[sl] = m
        pos_index[sl] = np.tile(idx, (t, 1))
        pos_weight[sl] = np.tile(wts, (t, 1))
        frame_index[sl] = np.repeat(np.arange(t, dtype=np.int32), h * w) if t > 1 else -1
        rope[sl] = np.tile(hw, (t, 1))

        gi, gj = np.meshgrid(np.arange(h // kh), np.arange(w // kw), indexing="ij")
        ki, kj = np.meshgrid(np.arange(kh), np.arange(kw), indexing="ij")
        r = gi.reshape(-1, 1) * kh + ki.reshape(1, -1)  # [tokens, K] patch row
        c = gj.reshape(-1, 1) * kw + kj.reshape(1, -1)  # [tokens, K] patch column
        within = (r * w + c).astype(np.int32)
        nt = tokens[m]
        for f in range(t):
            merge_index[n0:n0 + nt, :, f] = p0 + f * h * w + within
        merge_weight[n0:n0 + nt, :t] = np.float32(1.0 / t)
        p0 += n
        n0 += nt

    kv_start, block, window = attention_windows(seg, attn_block)
    return MediaPlan(grid, (kh, kw), n_real, t_real, seg, pos_index, pos_weight, frame_index, rope,
                     merge_index, merge_weight, kv_start, np.arange(block, dtype=np.int32),
                     np.arange(window, dtype=np.int32))


def bucket(n: int, minimum: int = 256) -> int:
    """The padded size a count ``n`` is rounded up to: the next power of two >= ``minimum``, then multiples of
    the largest power of two <= n / 8 (at most ~12.5% padding), so varied media reuse a few compiled shapes."""
    if n <= minimum:
        return minimum
    p = 1 << (n.bit_length() - 1)
    step = max(minimum, p // 8)
    return -(-n // step) * step

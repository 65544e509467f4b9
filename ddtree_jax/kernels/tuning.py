"""How each kernel tiles and splits its work by default: the tuning tables and the rules that apply them,
in one place (issue 22 item 2: results/h200/decode/run.sh sweeps around DECODE_TUNING).

Splits are flash-decoding's: a sequence's visible cache range cut into pieces that separate programs
stream, their float32 partials merged afterwards. How many pays depends on how many programs the
other grid axes already give (batch x heads x row tiles) against the SMs.

Sections: the Triton kernels (`tree_attention`, `mla_attention`: dict tables, `resolve_*_tuning` -> dict),
the grouped expert matmul, then the Mosaic GPU kernels (`tree_attention_mgpu`, `mla_attention_mgpu`:
frozen `*MgpuTuning` records, `resolve_*_mgpu_tuning`, their shared-memory counts and one split rule,
`default_mgpu_splits`, for both).
"""

from __future__ import annotations

import dataclasses

from ddtree_jax.kernels.flash import cdiv, next_pow2

NUM_SMS_H200 = 132

# -- tree attention (`tree_attention`) --------------------------------------------------------------
# `waves`: programs to aim for, in units of num_sms (splits fill the grid up to waves * num_sms
# programs); `min_tiles_per_split`: tile_k tiles a split streams at least.
# DECODE_TUNING applies when the packed query rows G * T fit one 16-row tile (T = 1 decode): short
# programs (one tile each at 1k context) fill the SMs, and a Pallas merge replaces XLA's fusions.
DECODE_TUNING = dict(tile_k=128, num_warps=4, num_stages=2, waves=4, min_tiles_per_split=1, merge="pallas")
TREE_TUNING = dict(tile_k=64, num_warps=4, num_stages=3, waves=2, min_tiles_per_split=4, merge="xla")
MERGES = ("pallas", "xla")
TREE_MAX_SPLITS = 64


def default_tree_splits(
    batch: int,
    kv_heads: int,
    row_tiles: int,
    cache_len: int,
    tile_k: int,
    *,
    num_sms: int = NUM_SMS_H200,
    min_tiles_per_split: int,
    waves: int,
) -> int:
    """Cache splits so that about `waves` programs run per SM, each with a few tiles to stream."""
    want = cdiv(waves * num_sms, batch * kv_heads * row_tiles)
    cap = max(1, cdiv(cache_len, tile_k * min_tiles_per_split))
    return max(1, min(want, cap, TREE_MAX_SPLITS))


def resolve_tree_tuning(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    *,
    tile_q: int | None = None,
    tile_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
    waves: int | None = None,
    min_tiles_per_split: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> dict:
    """The tuning `tree_attention` uses for q [B, T, Hq, D] over a cache [B, Hkv, S, D]; None picks the
    default.

    Defaults by packed rows G * T: one tile of up to 128 rows; a single 16-row tile (AR decode)
    takes `DECODE_TUNING`, larger trees `TREE_TUNING` and tile the rows over the grid's first axis.
    TREE_TUNING comes from the H200 sweep (results/h200/bench_attention.json, read in
    results/h200/README.md): 4 warps beat 8 everywhere, 3 stages beat 2 with 64-row K tiles, and
    128-row query tiles halve the K/V re-reads of big trees. `waves` and `min_tiles_per_split` only
    steer the default splits.
    """
    b, t, hq, d = q_shape
    hkv, s = cache_shape[1], cache_shape[2]
    g = hq // hkv
    if hq != g * hkv:
        raise ValueError(f"query heads {hq} not a multiple of K/V heads {hkv}")
    tile_q = tile_q or min(max(16, next_pow2(g * t)), 128)
    base = DECODE_TUNING if g * t <= 16 else TREE_TUNING
    tile_k = tile_k or base["tile_k"]
    num_warps = num_warps or base["num_warps"]
    # An explicit tile_k keeps the sweep's rule: 2 stages with 128-row tiles, 3 below.
    if num_stages is None:
        num_stages = base["num_stages"] if tile_k == base["tile_k"] else (2 if tile_k >= 128 else 3)
    merge = merge or base["merge"]
    if merge not in MERGES:
        raise ValueError(f"merge {merge!r} not one of {MERGES}")
    for name, v in (("tile_q", tile_q), ("tile_k", tile_k), ("head dim", d)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two >= 16")
    row_tiles = cdiv(g * t, tile_q)
    if splits is None:
        splits = default_tree_splits(
            b,
            hkv,
            row_tiles,
            s,
            tile_k,
            num_sms=num_sms,
            min_tiles_per_split=min_tiles_per_split or base["min_tiles_per_split"],
            waves=waves or base["waves"],
        )
    return dict(
        tile_q=tile_q,
        tile_k=tile_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        merge=merge,
        row_tiles=row_tiles,
    )


# -- absorbed MLA attention (`mla_attention`) -------------------------------------------------------
# From the first H200 run's fit (see `default_mla_splits` and results/notes.md, "The MLA kernel, second
# pass") and the sweep of scripts/bench_mla_attention.py (2026-12-01), by packed rows (T x H) of one
# sequence:
# - up to 16 (a TP8 shard's decode, 8 heads): MLA_DECODE_TUNING, one 16-row tile, 4 warps (the float32
#   accumulator, 16 x 512, is 64 registers per thread), two programs per SM.
# - above: MLA_TREE_TUNING, 64-row tiles with 8 warps (the configuration the first run compiled and
#   measured at T = 64): at TP1 decode (64 heads) ALL rows in ONE tile, so each cache tile is loaded
#   once per sequence and split where 16-row tiles loaded it 4 times, and a loop step does 4x the work
#   in the same measured time.
# Cache tiles of 576 keys: 64 rows (72 kB of bf16 per stage, 2 stages) behind 64-row tiles, where the
# H200 sweep measured them 1.1x / 1.4x / 1.3x faster than 32 (64 heads T = 1, 64 heads T = 64, 8 heads
# T = 64, all at 32k); 32 rows behind 16-row tiles (8 heads, T = 1: 50.8 us against 64.2).
MLA_DECODE_TUNING = dict(tile_q=16, tile_k=32, num_warps=4, num_stages=2)
MLA_TREE_TUNING = dict(tile_q=64, tile_k=64, num_warps=8, num_stages=2)
MLA_MAX_SPLITS = 256


def default_mla_splits(
    batch: int,
    row_tiles: int,
    cache_len: int,
    tile_k: int,
    *,
    num_sms: int = NUM_SMS_H200,
    min_tiles_per_split: int = 4,
    programs_per_sm: int = 1,
) -> int:
    """Cache splits (flash-decoding): the fewest within 10% of the least waves x tiles per program.

    `row_tiles` counts the programs of one sequence and split (row tiles x value splits). The first
    H200 run fits time = waves x tiles per program x 3.2 us (+ ~30 us of launches and combine) on
    every row, whatever the tile (16 or 64 rows, 4 or 8 warps): a program's loop step has a fixed
    latency, so what counts is the steps of the longest program, not bytes or FLOPs. Hence splits
    until the programs fill the SMs' slots (`programs_per_sm`: 2 for 4-warp 16-row tiles, 1 for the
    8-warp 64-row ones), counted in whole waves: at B = 1, T = 64, H = 64 (64 tiles) 3 splits make
    192 programs, two waves of a third of the cache each (2.2 ms measured), 2 splits one wave of
    half. A split's float32 partial is 2 kB per row, written and re-read: ties go to fewer splits.
    """
    num_tiles = cdiv(cache_len, tile_k)
    cap = max(1, min(MLA_MAX_SPLITS, cdiv(num_tiles, min_tiles_per_split)))
    slots = num_sms * programs_per_sm
    cost = {sp: cdiv(batch * row_tiles * sp, slots) * cdiv(num_tiles, sp) for sp in range(1, cap + 1)}
    least = min(cost.values())
    return min(sp for sp in cost if cost[sp] <= 1.1 * least)


def resolve_mla_tuning(
    q_shape: tuple[int, ...],
    cache_len: int,
    *,
    tile_q: int | None = None,
    tile_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    value_splits: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> dict:
    """The tuning `mla_attention` uses for q_latent's shape [B, T, H, C]; None picks the default.

    The row tile comes from the packed rows (MLA_DECODE_TUNING up to 16, else MLA_TREE_TUNING); the
    tile's table then gives tile_k, warps and stages. `value_splits` (default 1) splits the C output
    columns over programs sharing a row tile, each recomputing the scores: smaller accumulators at the
    price of the score matmul done again; C / value_splits must be a power of two >= 16.
    """
    b, t, h, c = q_shape
    rows = t * h
    tile_q = tile_q or (MLA_DECODE_TUNING if rows <= 16 else MLA_TREE_TUNING)["tile_q"]
    base = MLA_DECODE_TUNING if tile_q <= 16 else MLA_TREE_TUNING
    tile_k = tile_k or base["tile_k"]
    value_splits = value_splits or 1
    num_warps = num_warps or base["num_warps"]
    num_stages = num_stages or base["num_stages"]
    for name, v in (("tile_q", tile_q), ("tile_k", tile_k), ("C / value_splits", c // value_splits)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two >= 16")
    if c % value_splits:
        raise ValueError(f"value_splits = {value_splits} must divide the latent width {c}")
    row_tiles = cdiv(rows, tile_q)
    if splits is None:
        per_sm = 2 if tile_q <= 16 and num_warps <= 4 else 1
        programs = row_tiles * value_splits
        splits = default_mla_splits(b, programs, cache_len, tile_k, num_sms=num_sms, programs_per_sm=per_sm)
    return dict(
        tile_q=tile_q,
        tile_k=tile_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        value_splits=value_splits,
        row_tiles=row_tiles,
    )


# -- the grouped expert matmul (`quant_matmul.grouped_matmul`) --------------------------------------


def default_grouped_splits(
    programs: int, k_tiles: int, num_sms: int = NUM_SMS_H200, min_steps: int = 4
) -> int:
    """K splits so that about two programs run per SM, each streaming at least `min_steps` K tiles."""
    want = max(1, -(-2 * num_sms // programs))
    for s in range(min(want, max(1, k_tiles // min_steps)), 0, -1):
        if k_tiles % s == 0:
            return s
    return 1


# -- the few-token expert GEMV (`few_experts.expert_gemv`) ----------------------------------------
# Per format the largest tiles (powers of two dividing the expert's stored rows / columns); INT4 reads
# tile_k / 8 word rows a step as 8 dots of tile_k / 8 >= 16 rows, so tile_k >= 128. Splits of K fill
# about FEW_WAVES programs per SM, each streaming at least FEW_MIN_STEPS K tiles. Not measured yet:
# results/h200/recipes/moe_few_token.sh times the dispatch at these defaults.
FEW_TUNING = {
    "plain": dict(tile_n=128, tile_k=128, num_warps=4, num_stages=3),
    "fp8": dict(tile_n=128, tile_k=128, num_warps=4, num_stages=3),
    "int4": dict(tile_n=128, tile_k=256, num_warps=4, num_stages=3),
}
FEW_WAVES = 3
FEW_MIN_STEPS = 2


@dataclasses.dataclass(frozen=True)
class FewTuning:
    """Static shape of one `few_experts.expert_gemv` launch: see `resolve_few_tuning`."""

    tile_n: int  # output columns per program
    tile_k: int  # K rows per step
    splits: int  # programs along K per (slot, column tile)
    num_warps: int
    num_stages: int
    k_tiles: int

    @property
    def steps(self) -> int:
        """K tiles one program streams."""
        return self.k_tiles // self.splits


def _pow2_divisor(size: int, largest: int, smallest: int) -> int | None:
    """The largest power of two in [smallest, largest] dividing `size`, or None."""
    tile = largest
    while tile >= smallest:
        if size % tile == 0:
            return tile
        tile //= 2
    return None


def default_few_splits(
    programs: int,
    k_tiles: int,
    *,
    num_sms: int = NUM_SMS_H200,
    waves: int = FEW_WAVES,
    min_steps: int = FEW_MIN_STEPS,
) -> int:
    """K splits: the largest divisor of k_tiles up to what fills `waves` programs per SM, each split
    streaming at least `min_steps` tiles (one split when the grid fills the SMs already)."""
    want = max(1, cdiv(waves * num_sms, programs))
    cap = max(1, min(want, k_tiles // min_steps))
    return max(s for s in range(1, cap + 1) if k_tiles % s == 0)


def resolve_few_tuning(
    fmt: str,
    k_rows: int,
    n_cols: int,
    slots: int,
    *,
    block: tuple[int, int] = (1, 1),
    tile_n: int | None = None,
    tile_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> FewTuning:
    """The tuning of one few-token expert GEMV over weights [E, k_rows, n_cols] (stored rows: fp8
    padded to blocks, int4 8 per word) for `slots` experts; None picks the default (FEW_TUNING, the
    largest power-of-two tiles dividing the shape, `default_few_splits`). ValueError where no tile fits
    (the dispatch then takes the grouped kernel). Qwen3-30B-A3B at one token (8 slots), bf16: gate / up
    [2048, 768] tiles (128, 128), 16 K tiles in 8 splits (384 programs); down [768, 2048] 6 K tiles in 3."""
    base = FEW_TUNING[fmt]
    smallest_k = 128 if fmt == "int4" else 16
    largest_k = base["tile_k"] if fmt != "fp8" else min(base["tile_k"], block[0])
    tile_k = tile_k or _pow2_divisor(k_rows, largest_k, smallest_k)
    tile_n = tile_n or _pow2_divisor(n_cols, base["tile_n"], 16)
    if tile_k is None or tile_n is None:
        why = "tiles are powers of two >= 16 (int4: K tiles >= 128)"
        raise ValueError(f"no few-token tiles for [{k_rows}, {n_cols}] ({fmt}): {why}")
    if k_rows % tile_k or n_cols % tile_n:
        raise ValueError(f"K {k_rows} / N {n_cols} must be multiples of tile_k {tile_k} / tile_n {tile_n}")
    if fmt == "int4" and (tile_k % 128 or tile_k % block[0]):
        raise ValueError(f"int4 tile_k {tile_k} must be a multiple of 128 and of the group {block[0]}")
    if fmt == "fp8" and (block[0] % tile_k or block[1] % tile_n):
        raise ValueError(f"fp8 tiles ({tile_k}, {tile_n}) must nest in the scale block {block}")
    k_tiles = k_rows // tile_k
    splits = splits or default_few_splits(slots * (n_cols // tile_n), k_tiles, num_sms=num_sms)
    if k_tiles % splits:
        raise ValueError(f"splits {splits} must divide the {k_tiles} K tiles")
    return FewTuning(
        tile_n=tile_n,
        tile_k=tile_k,
        splits=splits,
        num_warps=num_warps or base["num_warps"],
        num_stages=num_stages or base["num_stages"],
        k_tiles=k_tiles,
    )


# -- the MoE dispatch on a GPU (`models.moe.choose_dispatch`) ---------------------------------------
# Per expert format ("plain", "fp8", "int4"), rows (largest tokens per device, dispatch) in ascending
# order: the first row whose bound holds wins, None = any count. What is measured so far (H200,
# results/notes.md and models/moe.py): `gather` up to 4 tokens, the Pallas `grouped` kernel above, in
# every format; `few` / `few_mgpu` (kernels/few_experts*.py) and `fused` enter only from a measured run:
# results/h200/recipes/moe_few_token.sh writes the rows its figures choose (`ddtree-bench moe`'s
# "dispatch_table": the fastest dispatch at each measured token count) to paste here.
MOE_GPU_DISPATCH: dict[str, tuple[tuple[int | None, str], ...]] = {
    "plain": ((4, "gather"), (None, "grouped")),
    "fp8": ((4, "gather"), (None, "grouped")),
    "int4": ((4, "gather"), (None, "grouped")),
}


def moe_gpu_dispatch(fmt: str, tokens: int, table: dict | None = None) -> str:
    """The dispatch `table` (default MOE_GPU_DISPATCH) gives `tokens` tokens per device of experts in
    format `fmt`."""
    for bound, dispatch in (table or MOE_GPU_DISPATCH)[fmt]:
        if bound is None or tokens <= bound:
            return dispatch
    raise ValueError(f"the MoE dispatch table for {fmt!r} ends below {tokens} tokens (last bound: None)")


def dispatch_table_rows(best: dict[int, str]) -> tuple[tuple[int | None, str], ...]:
    """Table rows from the fastest dispatch at each measured token count ({tokens: dispatch}): runs of
    one winner merged, each bound the largest count it won (a count between two measured ones takes the
    larger's winner), the last row open (None)."""
    rows: list[list] = []
    for tokens in sorted(best):
        if rows and rows[-1][1] == best[tokens]:
            rows[-1][0] = tokens
        else:
            rows.append([tokens, best[tokens]])
    if not rows:
        raise ValueError("no measured token count")
    rows[-1][0] = None
    return tuple((bound, dispatch) for bound, dispatch in rows)


# -- tree attention on Mosaic GPU (`tree_attention_mgpu`) -------------------------------------------
# A program is one or two 64-row compute warpgroups plus a TMA warpgroup; the rules count shared memory
# (about 100-227 kB a program, so one program per SM) and cut the cache into whole waves of programs.
WG_ROWS = 64  # rows of one wgmma (M) = query rows of one compute warpgroup
SMEM_LIMIT = 227 * 1024  # dynamic shared memory of one H100/H200 program (CTA)
SMEM_RESERVE = 4 * 1024  # barriers, reduction scratch, alignment
TREE_MGPU_MAX_SPLITS = 64
MMA_FORMS = ("registers", "smem")
# Mosaic GPU (jax 0.11.2) copies a cache tile into its (8, 64)-tiled shared-memory slot by a TMA over
# the cache viewed as 8-row tiles: the cache's length must be a multiple of 8 (else lowering fails:
# "dimension 2 must have size smaller or a multiple of its tiling 8"), and so must every tile's first
# row, the shifted-back last tile's S - tile_k included (else layout inference fails on an
# AssertionError in its own error path). attention.py sends such caches to the Triton kernel.
TMA_ROW_TILE = 8
TMA_ROW_TILE_WHY = "Mosaic GPU's TMA reads the cache in tiles of 8 rows (use the Triton kernel)"


@dataclasses.dataclass(frozen=True)
class TreeMgpuTuning:
    """Static shape of one `tree_attention_mgpu` call: see `resolve_tree_mgpu_tuning`."""

    tile_k: int  # cache rows per pipeline step (TMA box, wgmma N of Q K^T, K of P V)
    stages: int  # shared-memory slots of K and V in flight
    compute_wgs: int  # 64-row compute warpgroups per program (tile_q = 64 * compute_wgs)
    splits: int  # programs per (row tile, sequence, K/V head) along the cache
    pingpong: bool  # FA3's schedule barrier between two compute warpgroups
    mma_form: str  # "registers" | "smem" (see the module docstring)
    row_tiles: int
    rows: int  # packed rows R = T * G
    out_rows: int  # rows of the outputs: R rounded up to 8 in one 64-row tile, else whole tiles
    new_tiles: int  # in-flight tiles of tile_k rows

    @property
    def tile_q(self) -> int:
        return WG_ROWS * self.compute_wgs


def tree_mgpu_smem_bytes(tun: TreeMgpuTuning, head_dim: int, itemsize: int = 2) -> int:
    """Shared memory of one program: Q tiles, K/V slots (aliased by the float32 partial staging),
    P tiles in the "smem" form."""
    c = tun.compute_wgs
    q = c * WG_ROWS * head_dim * itemsize
    slots = 2 * tun.stages * tun.tile_k * head_dim * itemsize
    staging = c * WG_ROWS * (head_dim + 2) * 4 if tun.splits > 1 else 0
    p = c * WG_ROWS * tun.tile_k * itemsize if tun.mma_form == "smem" else 0
    return q + max(slots, staging) + p


def default_mgpu_splits(
    programs: int, num_tiles: int, *, overhead_tiles: int, max_splits: int, num_sms: int = NUM_SMS_H200
) -> int:
    """Cache splits of both Mosaic kernels: the fewest within 10% of the least
    waves x (tiles per split + `overhead_tiles`).

    One program per SM (a program holds ~100-225 kB of shared memory); `programs` counts those of one
    split. `overhead_tiles` charges each program's fixed prologue and epilogue in units of one
    tile's time: 1 for the tree kernel (Q load, pipeline fill, partial write), 3 for MLA (a query
    load of 72 kB at Kimi-K2 widths, one tile's bytes, and a float32 partial of 128 kB written and
    read again by the merge).
    """
    cap = max(1, min(max_splits, num_tiles))
    cost = {
        sp: cdiv(programs * sp, num_sms) * (cdiv(num_tiles, sp) + overhead_tiles)
        for sp in range(1, cap + 1)
    }
    least = min(cost.values())
    return min(sp for sp in cost if cost[sp] <= 1.1 * least)


def resolve_tree_mgpu_tuning(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    *,
    tile_k: int | None = None,
    stages: int | None = None,
    compute_wgs: int | None = None,
    splits: int | None = None,
    pingpong: bool | None = None,
    mma_form: str | None = None,
    num_sms: int = NUM_SMS_H200,
) -> TreeMgpuTuning:
    """The tuning `tree_attention_mgpu` uses for q [B, T, Hq, D] over a cache [B, Hkv, S, D]; None picks
    the default.

    Defaults: 128-row cache tiles (a [128, 128] bf16 TMA box, wgmma N = 128 for Q K^T), 2 stages
    (2 x 64 kB of K/V slots), one compute warpgroup up to 64 packed rows (T = 1 decode, T = 16 at
    G = 4), two above (128-row tiles: each cache tile read once per 128 rows), FA3's ping-pong with
    two, P from registers. Blocks of 64 rows where the cache is shorter than 128.
    """
    b, t, hq, d = q_shape
    hkv, s = cache_shape[1], cache_shape[2]
    g = hq // hkv
    if hq != g * hkv:
        raise ValueError(f"query heads {hq} not a multiple of K/V heads {hkv}")
    if d % 64 or d > 256:
        raise ValueError(f"head dim {d} must be a multiple of 64 up to 256 (TMA tiles of 64 columns)")
    rows = t * g
    tile_k = tile_k or (128 if s >= 128 else 64)
    if tile_k % 64 or tile_k > 256:
        raise ValueError(f"tile_k = {tile_k} must be 64, 128, 192 or 256")
    if s < tile_k:
        raise ValueError(f"cache length {s} is shorter than one tile of {tile_k} rows")
    if s % TMA_ROW_TILE:
        raise ValueError(f"cache length {s} is not a multiple of {TMA_ROW_TILE}: {TMA_ROW_TILE_WHY}")
    stages = stages or 2
    compute_wgs = compute_wgs or (1 if rows <= WG_ROWS else 2)
    if compute_wgs not in (1, 2):
        raise ValueError(f"compute_wgs = {compute_wgs} must be 1 or 2")
    pingpong = (compute_wgs == 2) if pingpong is None else pingpong
    if pingpong and compute_wgs != 2:
        raise ValueError("pingpong needs two compute warpgroups")
    mma_form = mma_form or "registers"
    if mma_form not in MMA_FORMS:
        raise ValueError(f"mma_form {mma_form!r} not one of {MMA_FORMS}")
    tile_q = WG_ROWS * compute_wgs
    row_tiles = cdiv(rows, tile_q)
    out_rows = -(-rows // 8) * 8 if row_tiles == 1 and compute_wgs == 1 else row_tiles * tile_q
    if splits is None:
        programs = row_tiles * b * hkv
        splits = default_mgpu_splits(
            programs, cdiv(s, tile_k), overhead_tiles=1, max_splits=TREE_MGPU_MAX_SPLITS, num_sms=num_sms
        )
    tun = TreeMgpuTuning(
        tile_k=tile_k,
        stages=stages,
        compute_wgs=compute_wgs,
        splits=splits,
        pingpong=pingpong,
        mma_form=mma_form,
        row_tiles=row_tiles,
        rows=rows,
        out_rows=out_rows,
        new_tiles=cdiv(t, tile_k),
    )
    if (need := tree_mgpu_smem_bytes(tun, d)) > SMEM_LIMIT - SMEM_RESERVE:
        raise ValueError(f"tuning {tun} needs {need} bytes of shared memory (limit {SMEM_LIMIT})")
    return tun


# -- absorbed MLA attention on Mosaic GPU (`mla_attention_mgpu`) --------------------------------------
# One 64-row tile of packed rows per program (two compute warpgroups split the value columns), the
# shared memory nearly full at Kimi-K2 widths; the constants above (WG_ROWS, SMEM_LIMIT, TMA_ROW_TILE,
# MMA_FORMS) hold for it too.
MLA_MGPU_MAX_SPLITS = 256
SMEM_ALIGN = 1024  # Mosaic GPU aligns every shared-memory buffer to 1 kB


@dataclasses.dataclass(frozen=True)
class MlaMgpuTuning:
    """Static shape of one `mla_attention_mgpu` call: see `resolve_mla_mgpu_tuning`."""

    tile_k: int  # cache entries per pipeline step
    stages: int  # shared-memory slots in flight
    splits: int  # programs per (row tile, sequence) along the cache
    mma_form: str  # "registers" | "smem"
    row_tiles: int
    rows: int  # packed rows T * H
    out_rows: int  # rows of the outputs: T * H rounded up to 8 in one tile, else whole tiles
    new_tiles: int  # in-flight tiles of tile_k entries


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SMEM_ALIGN) * SMEM_ALIGN


def mla_mgpu_smem_bytes(tun: MlaMgpuTuning, latent: int, rope: int, itemsize: int = 2) -> int:
    """Shared memory of one program (each buffer 1 kB-aligned, barriers 1 kB)."""
    q = _aligned(WG_ROWS * latent * itemsize) + _aligned(WG_ROWS * rope * itemsize)
    slots = tun.stages * (_aligned(tun.tile_k * latent * itemsize) + _aligned(tun.tile_k * rope * itemsize))
    staging = 2 * _aligned(WG_ROWS * latent // 2 * (4 if tun.splits > 1 else itemsize))
    p = _aligned(WG_ROWS * tun.tile_k * itemsize)
    stats = _aligned(2 * WG_ROWS * 4)
    return q + max(slots, staging) + p + stats + SMEM_ALIGN


def resolve_mla_mgpu_tuning(
    q_shape: tuple[int, ...],
    cache_len: int,
    rope_dim: int,
    *,
    tile_k: int | None = None,
    stages: int | None = None,
    splits: int | None = None,
    mma_form: str | None = None,
    num_sms: int = NUM_SMS_H200,
) -> MlaMgpuTuning:
    """The tuning `mla_attention_mgpu` uses for q_latent [B, T, H, C] over a cache of `cache_len` entries;
    None = default.

    Defaults: 64-entry tiles in 2 stages (2 x 72 kB at C = 512, R = 64: with the 72 kB query tile
    and P, 226 kB of the 227 kB a program may hold), P from registers; splits from `default_mgpu_splits`.
    """
    b, t, h, c = q_shape
    if c % 128 or c > 512:
        raise ValueError(f"latent dim {c} must be a multiple of 128 up to 512 (two value halves)")
    if rope_dim % 64:
        raise ValueError(f"rope dim {rope_dim} must be a multiple of 64 (TMA tiles of 64 columns)")
    tile_k = tile_k or 64
    if tile_k % 64 or tile_k > 256:
        raise ValueError(f"tile_k = {tile_k} must be a multiple of 64 up to 256")
    if cache_len < tile_k:
        raise ValueError(f"cache length {cache_len} is shorter than one tile of {tile_k} entries")
    if cache_len % TMA_ROW_TILE:
        raise ValueError(f"cache length {cache_len} is not a multiple of {TMA_ROW_TILE}: {TMA_ROW_TILE_WHY}")
    stages = stages or 2
    mma_form = mma_form or "registers"
    if mma_form not in MMA_FORMS:
        raise ValueError(f"mma_form {mma_form!r} not one of {MMA_FORMS}")
    rows = t * h
    row_tiles = cdiv(rows, WG_ROWS)
    out_rows = -(-rows // 8) * 8 if row_tiles == 1 else row_tiles * WG_ROWS
    if splits is None:
        num_tiles = cdiv(cache_len, tile_k)
        splits = default_mgpu_splits(
            row_tiles * b, num_tiles, overhead_tiles=3, max_splits=MLA_MGPU_MAX_SPLITS, num_sms=num_sms
        )
    tun = MlaMgpuTuning(
        tile_k=tile_k,
        stages=stages,
        splits=splits,
        mma_form=mma_form,
        row_tiles=row_tiles,
        rows=rows,
        out_rows=out_rows,
        new_tiles=cdiv(t, tile_k),
    )
    if (need := mla_mgpu_smem_bytes(tun, c, rope_dim)) > SMEM_LIMIT:
        raise ValueError(f"tuning {tun} needs {need} bytes of shared memory (limit {SMEM_LIMIT})")
    return tun

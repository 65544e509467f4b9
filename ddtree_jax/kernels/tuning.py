"""How each kernel tiles and splits its work by default: the tuning tables and the rules that apply them,
in one place (issue 22 item 2: scripts/h200_decode.sh sweeps around DECODE_TUNING).

Splits are flash-decoding's: a sequence's visible cache range cut into pieces that separate programs
stream, their float32 partials merged afterwards. How many pays depends on how many programs the
other grid axes already give (batch x heads x row tiles) against the SMs.
"""

from __future__ import annotations

from ddtree_jax.kernels.flash import cdiv, next_pow2

NUM_SMS_H200 = 132

# -- tree attention (`tree_attention`) --------------------------------------------------------------
# `waves`: programs to aim for, in units of num_sms (splits fill the grid up to waves * num_sms
# programs); `min_blocks_per_split`: block_k blocks a split streams at least.
# DECODE_TUNING applies when the packed query rows G * T fit one 16-row tile (T = 1 decode): short
# programs (one block each at 1k context) fill the SMs, and a Pallas merge replaces XLA's fusions.
DECODE_TUNING = dict(block_k=128, num_warps=4, num_stages=2, waves=4, min_blocks_per_split=1, merge="pallas")
TREE_TUNING = dict(block_k=64, num_warps=4, num_stages=3, waves=2, min_blocks_per_split=4, merge="xla")
MERGES = ("pallas", "xla")
TREE_MAX_SPLITS = 64


def default_tree_splits(
    batch: int,
    kv_heads: int,
    row_tiles: int,
    cache_len: int,
    block_k: int,
    *,
    num_sms: int = NUM_SMS_H200,
    min_blocks_per_split: int,
    waves: int,
) -> int:
    """Cache splits so that about `waves` programs run per SM, each with a few blocks to stream."""
    want = cdiv(waves * num_sms, batch * kv_heads * row_tiles)
    cap = max(1, cdiv(cache_len, block_k * min_blocks_per_split))
    return max(1, min(want, cap, TREE_MAX_SPLITS))


def resolve_tree_tuning(
    q_shape: tuple[int, ...],
    cache_shape: tuple[int, ...],
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    merge: str | None = None,
    waves: int | None = None,
    min_blocks_per_split: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> dict:
    """The tuning `tree_attention` uses for q [B, T, Hq, D] over a cache [B, Hkv, S, D]; None picks the
    default.

    Defaults by packed rows G * T: one tile of up to 128 rows; a single 16-row tile (AR decode)
    takes `DECODE_TUNING`, larger trees `TREE_TUNING` and tile the rows over the grid's first axis.
    TREE_TUNING comes from the H200 sweep (results/h200/bench_attention.json, read in
    results/h200/README.md): 4 warps beat 8 everywhere, 3 stages beat 2 with 64-row K blocks, and
    128-row query tiles halve the K/V re-reads of big trees. `waves` and `min_blocks_per_split` only
    steer the default splits.
    """
    b, t, hq, d = q_shape
    hkv, s = cache_shape[1], cache_shape[2]
    g = hq // hkv
    if hq != g * hkv:
        raise ValueError(f"query heads {hq} not a multiple of K/V heads {hkv}")
    block_q = block_q or min(max(16, next_pow2(g * t)), 128)
    base = DECODE_TUNING if g * t <= 16 else TREE_TUNING
    block_k = block_k or base["block_k"]
    num_warps = num_warps or base["num_warps"]
    # An explicit block_k keeps the sweep's rule: 2 stages with 128-row blocks, 3 below.
    if num_stages is None:
        num_stages = base["num_stages"] if block_k == base["block_k"] else (2 if block_k >= 128 else 3)
    merge = merge or base["merge"]
    if merge not in MERGES:
        raise ValueError(f"merge {merge!r} not one of {MERGES}")
    for name, v in (("block_q", block_q), ("block_k", block_k), ("head dim", d)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two >= 16")
    row_tiles = cdiv(g * t, block_q)
    if splits is None:
        splits = default_tree_splits(
            b,
            hkv,
            row_tiles,
            s,
            block_k,
            num_sms=num_sms,
            min_blocks_per_split=min_blocks_per_split or base["min_blocks_per_split"],
            waves=waves or base["waves"],
        )
    return dict(
        block_q=block_q,
        block_k=block_k,
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
#   measured at T = 64): at TP1 decode (64 heads) ALL rows in ONE tile, so each cache block is loaded
#   once per sequence and split where 16-row tiles loaded it 4 times, and a loop step does 4x the work
#   in the same measured time.
# Cache blocks of 576 keys: 64 rows (72 kB of bf16 per stage, 2 stages) behind 64-row tiles, where the
# H200 sweep measured them 1.1x / 1.4x / 1.3x faster than 32 (64 heads T = 1, 64 heads T = 64, 8 heads
# T = 64, all at 32k); 32 rows behind 16-row tiles (8 heads, T = 1: 50.8 us against 64.2).
MLA_DECODE_TUNING = dict(block_q=16, block_k=32, num_warps=4, num_stages=2)
MLA_TREE_TUNING = dict(block_q=64, block_k=64, num_warps=8, num_stages=2)
MLA_MAX_SPLITS = 256


def default_mla_splits(
    batch: int,
    row_tiles: int,
    cache_len: int,
    block_k: int,
    *,
    num_sms: int = NUM_SMS_H200,
    min_blocks_per_split: int = 4,
    programs_per_sm: int = 1,
) -> int:
    """Cache splits (flash-decoding): the fewest within 10% of the least waves x blocks per program.

    `row_tiles` counts the programs of one sequence and split (row tiles x value splits). The first
    H200 run fits time = waves x blocks per program x 3.2 us (+ ~30 us of launches and combine) on
    every row, whatever the tile (16 or 64 rows, 4 or 8 warps): a program's loop step has a fixed
    latency, so what counts is the steps of the longest program, not bytes or FLOPs. Hence splits
    until the programs fill the SMs' slots (`programs_per_sm`: 2 for 4-warp 16-row tiles, 1 for the
    8-warp 64-row ones), counted in whole waves: at B = 1, T = 64, H = 64 (64 tiles) 3 splits make
    192 programs, two waves of a third of the cache each (2.2 ms measured), 2 splits one wave of
    half. A split's float32 partial is 2 kB per row, written and re-read: ties go to fewer splits.
    """
    num_blocks = cdiv(cache_len, block_k)
    cap = max(1, min(MLA_MAX_SPLITS, cdiv(num_blocks, min_blocks_per_split)))
    slots = num_sms * programs_per_sm
    cost = {sp: cdiv(batch * row_tiles * sp, slots) * cdiv(num_blocks, sp) for sp in range(1, cap + 1)}
    least = min(cost.values())
    return min(sp for sp in cost if cost[sp] <= 1.1 * least)


def resolve_mla_tuning(
    q_shape: tuple[int, ...],
    cache_len: int,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    value_splits: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> dict:
    """The tuning `mla_attention` uses for q_latent's shape [B, T, H, C]; None picks the default.

    The row tile comes from the packed rows (MLA_DECODE_TUNING up to 16, else MLA_TREE_TUNING); the
    tile's table then gives block_k, warps and stages. `value_splits` (default 1) splits the C output
    columns over programs sharing a row tile, each recomputing the scores: smaller accumulators at the
    price of the score matmul done again; C / value_splits must be a power of two >= 16.
    """
    b, t, h, c = q_shape
    rows = t * h
    block_q = block_q or (MLA_DECODE_TUNING if rows <= 16 else MLA_TREE_TUNING)["block_q"]
    base = MLA_DECODE_TUNING if block_q <= 16 else MLA_TREE_TUNING
    block_k = block_k or base["block_k"]
    value_splits = value_splits or 1
    num_warps = num_warps or base["num_warps"]
    num_stages = num_stages or base["num_stages"]
    for name, v in (("block_q", block_q), ("block_k", block_k), ("C / value_splits", c // value_splits)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name} = {v} must be a power of two >= 16")
    if c % value_splits:
        raise ValueError(f"value_splits = {value_splits} must divide the latent width {c}")
    row_tiles = cdiv(rows, block_q)
    if splits is None:
        per_sm = 2 if block_q <= 16 and num_warps <= 4 else 1
        programs = row_tiles * value_splits
        splits = default_mla_splits(b, programs, cache_len, block_k, num_sms=num_sms, programs_per_sm=per_sm)
    return dict(
        block_q=block_q,
        block_k=block_k,
        splits=splits,
        num_warps=num_warps,
        num_stages=num_stages,
        value_splits=value_splits,
        row_tiles=row_tiles,
    )


# -- the grouped expert matmul (`quant_matmul.grouped_matmul`) --------------------------------------


def default_grouped_splits(
    programs: int, k_blocks: int, num_sms: int = NUM_SMS_H200, min_steps: int = 4
) -> int:
    """K splits so that about two programs run per SM, each streaming at least `min_steps` K blocks."""
    want = max(1, -(-2 * num_sms // programs))
    for s in range(min(want, max(1, k_blocks // min_steps)), 0, -1):
        if k_blocks % s == 0:
            return s
    return 1

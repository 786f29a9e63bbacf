// Prepended by the host (src/gpu/shaders.rs) to every kernel: the uniform
// block, the rows' visible key ranges, and the attention variants of
// crate::variants (softcap and ALiBi, declared in lib/variants.wgsl with
// decoding's; mask, sinks, Philox dropout). Each variant is an override,
// off by default, so that a plain call's pipeline specialises all of it
// away and runs the code it ran before variants.

override MASK: bool = false;
override SINKS: bool = false;
override DROPOUT: bool = false;
// A left window bound: rows start later than key 0.
override WINDOW: bool = false;
// Whether score() changes u at all.
override MODIFIES: bool = SOFTCAP || ALIBI || MASK;
// A packed batch of variable-length sequences (attention_varlen): each
// row's keys, diagonal and sequence come from the row table in vx
// (src/gpu/varlen.rs) instead of the uniform's offsets. The host sets
// WINDOW with it (rows start later than key 0), which switches the
// kernels' per-row starts on.
override VARLEN: bool = false;
// Mirrors `params` in src/gpu/mod.rs, word for word.
struct Params {
    seq_q: u32,
    seq_k: u32,
    // Query heads per key/value head.
    group: u32,
    // Index within its GQA group of the first query head bound in this
    // dispatch; with `group` it locates the key/value head of every query
    // head.
    q_head0: u32,
    // 1 when rows end before seq_k: causal and/or a right window.
    causal: u32,
    // Row i sees keys below i + causal_offset + 1 (with `causal`). The
    // host clamps it (and left_offset) to [-seq_q, seq_k], which cuts the
    // same keys, so that sums with a row or a key stay in i32.
    causal_offset: i32,
    scale: f32,
    // Query heads of each key/value head bound in this dispatch (the whole
    // group, or a slice of it when one group is too large to bind at once).
    g_count: u32,
    // Flat (batch * heads_q + head) index of the first bound query head:
    // the variants' data is indexed by the absolute head.
    head0: u32,
    heads_q: u32,
    // q_offset - k_offset (by default seq_k - seq_q): the ALiBi distance
    // is |i + diag_offset - j|.
    diag_offset: i32,
    // Row i sees keys from i + left_offset (with WINDOW).
    left_offset: i32,
    softcap: f32,
    // 1 / (1 - dropout p).
    keep_scale: f32,
    drop_threshold: u32,
    seed_lo: u32,
    seed_hi: u32,
    // The additive mask's element strides (0 where it broadcasts), extents
    // and block map (crate::variants::AdditiveMask), all inside `vx`.
    mask_sb: u32,
    mask_sh: u32,
    mask_sr: u32,
    mask_sk: u32,
    mask_db: u32,
    mask_dh: u32,
    mask_dr: u32,
    mask_dk: u32,
    mask_bcr: u32,
    mask_bck: u32,
    blocks_off: u32,
    slopes_off: u32,
    sinks_off: u32,
    // The row table of a packed batch (VARLEN) in vx.
    rows_off: u32,
    // To 32 words: 128 bytes, a multiple of the 16-byte uniform alignment.
    pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// The variants' arrays, one buffer: the mask (f32 bits) from 0, its block
// map (one word per block) from blocks_off, ALiBi slopes per flat query
// head from slopes_off, sinks per query head from sinks_off, a packed
// batch's row table from rows_off.
@group(0) @binding(15) var<storage, read> vx: array<u32>;

// The online softmax has one vocabulary in every kernel: row_max (the
// running maximum m of a row's scores), row_sum (the running sum l of
// exp(s - row_max)), rescale (exp(row_max_old - row_max_new), applied to
// the accumulator and the sum when row_max grows), acc (the unnormalised
// output accumulator), lse, and delta (D = rowsum(dO o O), from the
// backward pre-pass). Register tiles keep the stem (acc00, ...).
//
// NEG_BIG is the GPU's stand-in for the CPU's -inf running maximum: a row
// whose row_max is NEG_BIG has seen no key yet (src/cpu/softmax.rs starts
// at -inf). WGSL does not promise IEEE infinities in arithmetic, so no
// -inf ever enters a subtraction here; exp(NEG_BIG - finite) is 0, which
// is what the first visible key needs. score() returns NEG_BIG for a key
// the mask hides. The lse of a row that saw no key is still -inf on both
// backends (src/cpu/softmax.rs, finish): the kernels write it as the bits
// 0xff800000 where row_sum is 0 (finish_row below; simple/forward.wgsl and
// coop/forward.wgsl at the end; tiled/forward.wgsl's `neg_inf`), and the
// backward kernels read an lse of -inf as "no key: P = 0". In the simple
// kernels NaN and infinities follow lib/nonfinite.wgsl: a row's NaN (+inf)
// score or sink gives lse NaN (+inf) and o NaN; the backward pre-pass
// writes NaN as the lse of a row whose lse is NaN or +inf or whose D is
// not finite, and the backward kernels give such a row's pairs P = dS =
// NaN (row_status). The tiled and cooperative kernels run only where
// screen.wgsl found none of them in the inputs.
const NEG_BIG: f32 = -3.0e38;
const MASK_BLOCK: u32 = 16u;
// The tiled and cooperative kernels take their exponentials in base 2.
const LOG2E: f32 = 1.4426950408889634;

// Checked on the bits: WGSL does not promise IEEE infinities.
fn is_finite(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

// Whether score() left a score shown, not NEG_BIG: on the bits, since a
// float comparison with a NaN score may come out either way (a driver's
// ordered compare says false; lib/nonfinite.wgsl).
fn shown(s: f32) -> bool {
    return bitcast<u32>(s) != bitcast<u32>(NEG_BIG);
}

// Word `w` of `row`'s entry in the row table (VARLEN): 0 its first key,
// 1 the end of its keys, 2 its diagonal offset (i32 bits), 3 its
// sequence. Rows past seq_q (the padding rows of a tile) read the last
// row's: any end up to seq_k is harmless for them.
fn varlen_row(row: u32, w: u32) -> u32 {
    return vx[p.rows_off + 4u * min(row, p.seq_q - 1u) + w];
}

// Word `w` of key boundary `key` (0..=seq_k) in the table after the rows:
// 0 the first row whose keys end after `key`, 1 the first row whose keys
// start at or after it.
fn varlen_key(key: u32, w: u32) -> u32 {
    return vx[p.rows_off + 4u * p.seq_q + 2u * min(key, p.seq_k) + w];
}

// Causal and the right window, at the call's positions (by default
// bottom-right aligned): query `row` sees keys below visible_end.
fn visible_end(row: u32) -> u32 {
    if VARLEN {
        return varlen_row(row, 1u);
    }
    if p.causal == 0u {
        return p.seq_k;
    }
    return u32(clamp(i32(row) + p.causal_offset + 1, 0, i32(p.seq_k)));
}

// The left window: query `row` sees keys from visible_start. The range
// may be empty (start >= end).
fn visible_start(row: u32) -> u32 {
    if !WINDOW {
        return 0u;
    }
    if VARLEN {
        return varlen_row(row, 0u);
    }
    return u32(clamp(i32(row) + p.left_offset, 0, i32(p.seq_k)));
}

// The first query row past those that can see key `key` through the left
// window (rows grow their start with their index).
fn rows_seeing_end(key_end: u32) -> u32 {
    if !WINDOW {
        return p.seq_q;
    }
    if VARLEN {
        return varlen_key(key_end, 1u);
    }
    return u32(clamp(i32(key_end) - p.left_offset, 0, i32(p.seq_q)));
}

// VARLEN: the first query row that sees any key from `key` on (rows' ends
// grow with their index); the dK/dV kernels start their rows there.
fn varlen_first_row(key: u32) -> u32 {
    return varlen_key(key, 0u);
}

fn sink_of(bh: u32) -> f32 {
    return bitcast<f32>(vx[p.sinks_off + bh % p.heads_q]);
}

// The code (lib/nonfinite.wgsl) of head bh's sink: a NaN or +inf sink
// makes every row of the head NaN or infinite, like a score.
fn sink_code(bh: u32) -> f32 {
    if !SINKS {
        return 0.0;
    }
    return nonfinite_code(sink_of(bh));
}

// How the backward treats a query row, from the lse in its stats (the
// pre-pass's): x = 1 where it saw a key (lse not -inf), y = 1 where it is
// poisoned (lse NaN: its pairs get P = dS = NaN).
fn row_status(lse: f32) -> vec2<bool> {
    let seen = bitcast<u32>(lse) != 0xff800000u;
    return vec2(seen, seen && !is_finite(lse));
}

fn softcap_tanh(u: f32) -> f32 {
    return tanh_f32(u / p.softcap);
}

// The score s of (flat head bh, row, key) from u = scale * q . k, as
// crate::variants defines it: softcap, ALiBi, then the mask; NEG_BIG where
// a -inf mask entry hides the key.
fn score(u: f32, bh: u32, row: u32, key: u32) -> f32 {
    var slope = 0.0;
    var distance = 0;
    if ALIBI {
        if VARLEN {
            // Distances within the row's sequence, with its slopes.
            slope = bitcast<f32>(vx[p.slopes_off + varlen_row(row, 3u) * p.heads_q + bh]);
            let diagonal = bitcast<i32>(varlen_row(row, 2u));
            distance = abs(i32(row) + diagonal - i32(key));
        } else {
            slope = bitcast<f32>(vx[p.slopes_off + bh]);
            distance = abs(i32(row) + p.diag_offset - i32(key));
        }
    }
    var s = variant_score(u, p.softcap, slope, distance);
    if MASK {
        // The tiled kernels score padding rows and keys too, and run
        // without bounds checks: only real ones read the mask.
        if row >= p.seq_q || key >= p.seq_k {
            return NEG_BIG;
        }
        let b = bh / p.heads_q;
        let h = bh % p.heads_q;
        let bits = vx[b * p.mask_sb + h * p.mask_sh + row * p.mask_sr + key * p.mask_sk];
        if bits == 0xff800000u {
            return NEG_BIG;
        }
        s += bitcast<f32>(bits);
    }
    return s;
}

// P of one pair of a row that is not poisoned (row_status), from its score
// and the row's lse: a score that is not finite weighs 0 if -inf, else NaN
// (docs/design.md#non-finite-inputs).
fn pair_weight(s: f32, lse: f32) -> f32 {
    if !is_finite(s) {
        return select(nan_f32(), 0.0, bitcast<u32>(s) == 0xff800000u);
    }
    return exp(s - lse);
}

// dS -> dU: the softcap's derivative 1 - tanh^2, tanh recomputed from u.
fn softcap_grad(ds: f32, u: f32) -> f32 {
    if !SOFTCAP {
        return ds;
    }
    let t = softcap_tanh(u);
    return ds * (1.0 - t * t);
}

// Whether the mask leaves any score of rows [r0, r1) x keys [c0, c1) of
// head bh (from the block map): false lets a workgroup skip the tile.
// Reads only the read-only buffer at uniform indices, so the answer is
// uniform across the workgroup.
fn mask_tile_visible(bh: u32, r0: u32, r1: u32, c0: u32, c1: u32) -> bool {
    if !MASK || r0 >= r1 || c0 >= c1 {
        return true;
    }
    let b = min(bh / p.heads_q, p.mask_db - 1u);
    let h = min(bh % p.heads_q, p.mask_dh - 1u);
    let plane = p.blocks_off + (b * p.mask_dh + h) * p.mask_bcr * p.mask_bck;
    var rb0 = 0u;
    var rb1 = 1u;
    if p.mask_dr != 1u {
        rb0 = r0 / MASK_BLOCK;
        rb1 = (r1 - 1u) / MASK_BLOCK + 1u;
    }
    var kb0 = 0u;
    var kb1 = 1u;
    if p.mask_dk != 1u {
        kb0 = c0 / MASK_BLOCK;
        kb1 = (c1 - 1u) / MASK_BLOCK + 1u;
    }
    var any = false;
    for (var rb = rb0; rb < rb1; rb++) {
        for (var kb = kb0; kb < kb1; kb++) {
            any = any || vx[plane + rb * p.mask_bck + kb] != 0u;
        }
    }
    return any;
}

// The first of the tiles starting at k, k + step, ... below `end` in which
// the mask leaves any score of rows [r0, r1); `end` or more if none. The
// tiled kernels step from visible tile to visible tile, so a hidden one
// costs neither loads nor a register prefetch. Uniform like
// mask_tile_visible.
fn next_visible_tile(bh: u32, r0: u32, r1: u32, k: u32, end: u32, step: u32) -> u32 {
    var t = k;
    if MASK {
        while t < end && !mask_tile_visible(bh, r0, r1, t, min(t + step, end)) {
            t += step;
        }
    }
    return t;
}

// 32 x 32 -> 64-bit product as (hi, lo): WGSL has no u64.
fn mulhilo(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let p11 = a1 * b1;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let hi = p11 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2(hi, a * b);
}

// Philox4x32-10 keyed by the call's seed: crate::variants::philox4x32_10.
fn philox(counter: vec4<u32>) -> vec4<u32> {
    var c = counter;
    var k = vec2(p.seed_lo, p.seed_hi);
    for (var round = 0u; round < 10u; round++) {
        if round > 0u {
            k += vec2(0x9E3779B9u, 0xBB67AE85u);
        }
        let m0 = mulhilo(0xD2511F53u, c.x);
        let m1 = mulhilo(0xCD9E8D57u, c.z);
        c = vec4(m1.x ^ c.y ^ k.x, m1.y, m0.x ^ c.w ^ k.y, m0.y);
    }
    return c;
}

// Whether dropout keeps score (bh, row, key): crate::variants::DropoutMask.
fn keeps(bh: u32, row: u32, key: u32) -> bool {
    if !DROPOUT {
        return true;
    }
    let w = philox(vec4(key >> 2u, row, bh, 0u));
    return w[key & 3u] >= p.drop_threshold;
}

// Whether dropout keeps keys 4 * group + b (b < 4) of (bh, row), as bit b:
// one Philox call yields the words of four consecutive keys.
fn keep_bits4(bh: u32, row: u32, group: u32) -> u32 {
    let w = philox(vec4(group, row, bh, 0u));
    let t = p.drop_threshold;
    return select(0u, 1u, w.x >= t) | select(0u, 2u, w.y >= t) | select(0u, 4u, w.z >= t)
        | select(0u, 8u, w.w >= t);
}

// Z = keep / (1 - p): the factor dropout puts on a probability.
fn dropout_factor(bh: u32, row: u32, key: u32) -> f32 {
    if !DROPOUT {
        return 1.0;
    }
    return select(0.0, p.keep_scale, keeps(bh, row, key));
}

// The output divisor and lse of a row from its row_max and row_sum
// (natural units), with the sink logit in the denominator: the sink takes
// probability mass but adds nothing to the output. The output is
// acc / divisor, and 0 where the divisor is 0: a row that saw no key, whose
// lse is -inf (or the sink, with a sink). A divisor rather than a factor,
// so that a sink of -inf and no dropout divide by row_sum exactly as the
// plain kernels do, bit for bit. A NaN or +inf sink is the caller's
// (sink_code), as is a row's NaN or +inf score.
fn finish_row(bh: u32, row_max: f32, row_sum: f32) -> vec2<f32> {
    let neg_inf = bitcast<f32>(0xff800000u);
    if SINKS {
        let sink = sink_of(bh);
        if is_finite(sink) {
            let row_max_new = max(row_max, sink);
            let rescale = exp(row_max - row_max_new);
            let sum = row_sum * rescale + exp(sink - row_max_new);
            // rescale = 0 (the sink dwarfs every score) gives an infinite
            // divisor and an output of 0, its limit.
            return vec2(sum / (rescale * p.keep_scale), row_max_new + log(sum));
        }
    }
    if row_sum > 0.0 {
        return vec2(row_sum / p.keep_scale, row_max + log(row_sum));
    }
    return vec2(0.0, neg_inf);
}

// The vec4 forms the register-tiled kernels use: four (row, key) pairs.
fn score4(u: vec4<f32>, bh: u32, rows: vec4<u32>, keys: vec4<u32>) -> vec4<f32> {
    return vec4(
        score(u.x, bh, rows.x, keys.x),
        score(u.y, bh, rows.y, keys.y),
        score(u.z, bh, rows.z, keys.z),
        score(u.w, bh, rows.w, keys.w),
    );
}

fn dropout4(bh: u32, rows: vec4<u32>, keys: vec4<u32>) -> vec4<f32> {
    return vec4(
        dropout_factor(bh, rows.x, keys.x),
        dropout_factor(bh, rows.y, keys.y),
        dropout_factor(bh, rows.z, keys.z),
        dropout_factor(bh, rows.w, keys.w),
    );
}

fn softcap_grad4(ds: vec4<f32>, u: vec4<f32>) -> vec4<f32> {
    if !SOFTCAP {
        return ds;
    }
    let x = u / p.softcap;
    let t = vec4(tanh_f32(x.x), tanh_f32(x.y), tanh_f32(x.z), tanh_f32(x.w));
    return ds * (1.0 - t * t);
}

// Decoding over a KV cache (flashport.attention_with_kvcache), split-KV:
// one workgroup per (sequence, key/value head, key split, block of RB
// query rows), where the rows are the head's whole GQA group times seq_q
// (row r = g * seq_q + i), so each cached key and value is read once per
// group. It writes the split's attention state, o normalised and lse, in
// float32; decode/combine.wgsl merges the splits in order. src/decode.rs
// defines what is computed, src/gpu/decode/ runs it.
//
// The host prepends lib/input_f32.wgsl or lib/input_f16.wgsl (In4, widen,
// in_word, in_elem), decode/load_vec4.wgsl or decode/load_elements.wgsl
// (the cache bindings and load_k / load_v) and decode/shared.wgsl (the
// uniform, the other bindings, cache_row, bound, visible, keys_read and
// split_keys, which decode/subgroup.wgsl shares).
//
// Layout of the invocations: KG = WG / LANES key groups of LANES lanes.
// Lane l of a key group owns elements 4l..4l+3 of d and of d_v; the group
// owns keys kg, kg + KG, ... of each tile of BK = KG * KPL keys. So the
// lanes of a key group read one cache row together, consecutive lanes
// consecutive words, and K and V go from memory to registers once,
// without staging: only the partial dot products, the scores and the
// per-row statistics pass through workgroup memory. Per tile:
//
// 1. every lane issues its KPL key rows' and value rows' loads;
// 2. partial dots q_r . k (4 elements) per row and key into `part`;
// 3. one invocation per (row, key) sums its LANES partials in lane order:
//    the score, with softcap, ALiBi and visibility (NEG_BIG where hidden);
// 4. one invocation per row folds the tile into row_max / row_sum (the
//    online softmax of lib/common.wgsl's vocabulary) and leaves the
//    probabilities in `scores` and the rescale in `stat`;
// 5. every lane rescales its accumulators and adds p * v for its keys.
//
// At the end the key groups' accumulators are summed in group order
// through `part`. The register tiles (q0..q7, acc0..acc7, k0..k3, v0..v3)
// are named variables (docs/gpu.md#named-register-variables); RB and KPL
// switch the unused ones off.

override WG: u32 = 128u;
override LANES: u32 = 32u;
// Keys per lane per tile, 1, 2 or 4.
override KPL: u32 = 4u;
// Rows per workgroup, 1, 2, 4 or 8.
override RB: u32 = 4u;
override KG: u32 = WG / LANES;
override BK: u32 = KG * KPL;
// A (row, key)'s partials are LANES + 1 apart, so that the invocations
// summing consecutive pairs read different banks.
override PS: u32 = LANES + 1u;
// max(RB * BK * PS, RB * KG * LANES * 4): the partials, or the key groups'
// accumulators at the end.
override PART_ELEMS: u32 = 4224u;
override SCORE_ELEMS: u32 = 64u;

var<workgroup> part: array<f32, PART_ELEMS>;
var<workgroup> scores: array<f32, SCORE_ELEMS>;
// Per row: the tile's rescale (0..8), and at the end row_sum (8..16), a
// slot of its own because the last tile's rescales may still be read, and
// the row's code (16..24, lib/nonfinite.wgsl).
var<workgroup> stat: array<f32, 24>;
// docs/design.md#non-finite-inputs: k0 + 1 for each key of the tile whose
// value held a NaN or an infinity (loaded as 0), and in vbad_any where any
// did (k0 + 1: no reset between tiles).
var<workgroup> vbad: array<u32, BK>;
var<workgroup> vbad_any: u32;

// A value vector of key `kt` of the tile at `k0`, NaN and infinities as 0
// and flagged.
fn clean_value(x: vec4<f32>, kt: u32, k0: u32) -> vec4<f32> {
    if all(finite4(x)) {
        return x;
    }
    vbad[kt] = k0 + 1u;
    vbad_any = k0 + 1u;
    return clean4(x);
}

// The score of group row `r` (query i = r % seq_q, head h * group +
// r / seq_q) and key `key` from u = scale * q . k, or NEG_BIG where the
// row does not see the key.
fn score(x: f32, b: u32, h: u32, len: u32, r: u32, key: u32, key_end: u32) -> f32 {
    let i = r % u.seq_q;
    let seen = visible(len, i);
    if r >= u.rows || key >= key_end || key < seen.x || key >= seen.y || !bound(b, key) {
        return NEG_BIG;
    }
    var slope = 0.0;
    var distance = 0;
    if ALIBI {
        let head = h * u.group + r / u.seq_q;
        slope = bitcast<f32>(seq_data[u.slopes_off + b * u.heads_q + head]);
        let pos = i32(len) - i32(u.seq_q) + i32(i);
        distance = abs(pos - i32(key));
    }
    return variant_score(x, u.softcap, slope, distance);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) t: u32,
) {
    let s = wid.x;
    let rb = wid.y % u.row_blocks;
    // (sequence, key/value head) of this dispatch.
    let seq_head = wid.y / u.row_blocks;
    let b = seq_head / u.heads_kv;
    let h = seq_head % u.heads_kv;
    let lane = t % LANES;
    let kg = t / LANES;
    let row0 = rb * RB;
    // Read-only storage at uniform indices: uniform values, so the tile
    // loop below (and its barriers) is uniform.
    let len = seq_data[u.seqlens_off + b];
    let split = split_keys(keys_read(len), s);
    // The keys the block's rows see.
    let block = block_keys(len, split, row0, RB);
    let key_start = block.x;
    let key_end = block.y;

    // The q rows of the group are consecutive: heads h * group.., each
    // seq_q rows; rows past the group read row 0 (and are never written).
    let q_first = seq_head * u.rows;
    var q0 = vec4(0.0);
    var q1 = vec4(0.0);
    var q2 = vec4(0.0);
    var q3 = vec4(0.0);
    var q4 = vec4(0.0);
    var q5 = vec4(0.0);
    var q6 = vec4(0.0);
    var q7 = vec4(0.0);
    let last = u.rows - 1u;
    q0 = load_q(q_first + min(row0, last), lane);
    if RB > 1u {
        q1 = load_q(q_first + min(row0 + 1u, last), lane);
    }
    if RB > 2u {
        q2 = load_q(q_first + min(row0 + 2u, last), lane);
        q3 = load_q(q_first + min(row0 + 3u, last), lane);
    }
    if RB > 4u {
        q4 = load_q(q_first + min(row0 + 4u, last), lane);
        q5 = load_q(q_first + min(row0 + 5u, last), lane);
        q6 = load_q(q_first + min(row0 + 6u, last), lane);
        q7 = load_q(q_first + min(row0 + 7u, last), lane);
    }
    var acc0 = vec4(0.0);
    var acc1 = vec4(0.0);
    var acc2 = vec4(0.0);
    var acc3 = vec4(0.0);
    var acc4 = vec4(0.0);
    var acc5 = vec4(0.0);
    var acc6 = vec4(0.0);
    var acc7 = vec4(0.0);
    // Held by invocation t < RB for row row0 + t.
    var row_max = NEG_BIG;
    var row_sum = 0.0;
    var code = 0.0;
    for (var j = t; j < BK; j += WG) {
        vbad[j] = 0u;
    }
    if t == 0u {
        vbad_any = 0u;
    }

    for (var k0 = key_start; k0 < key_end; k0 += BK) {
        // 1. Loads: key kk * KG + kg of the tile, zeros past key_end.
        var k0v = vec4(0.0);
        var k1v = vec4(0.0);
        var k2v = vec4(0.0);
        var k3v = vec4(0.0);
        var v0v = vec4(0.0);
        var v1v = vec4(0.0);
        var v2v = vec4(0.0);
        var v3v = vec4(0.0);
        let key0 = k0 + kg;
        if key0 < key_end && bound(b, key0) {
            let row = cache_row(b, h, key0);
            k0v = load_k(row, lane);
            v0v = clean_value(load_v(row, lane), kg, k0);
        }
        if KPL > 1u {
            let key1 = key0 + KG;
            if key1 < key_end && bound(b, key1) {
                let row = cache_row(b, h, key1);
                k1v = load_k(row, lane);
                v1v = clean_value(load_v(row, lane), KG + kg, k0);
            }
        }
        if KPL > 2u {
            let key2 = key0 + 2u * KG;
            if key2 < key_end && bound(b, key2) {
                let row = cache_row(b, h, key2);
                k2v = load_k(row, lane);
                v2v = clean_value(load_v(row, lane), 2u * KG + kg, k0);
            }
            let key3 = key0 + 3u * KG;
            if key3 < key_end && bound(b, key3) {
                let row = cache_row(b, h, key3);
                k3v = load_k(row, lane);
                v3v = clean_value(load_v(row, lane), 3u * KG + kg, k0);
            }
        }

        // 2. Partial dot products: row r, tile key kk * KG + kg, lane.
        let rs = BK * PS;
        var at = kg * PS + lane;
        part[at] = dot(q0, k0v);
        if RB > 1u {
            part[at + rs] = dot(q1, k0v);
        }
        if RB > 2u {
            part[at + 2u * rs] = dot(q2, k0v);
            part[at + 3u * rs] = dot(q3, k0v);
        }
        if RB > 4u {
            part[at + 4u * rs] = dot(q4, k0v);
            part[at + 5u * rs] = dot(q5, k0v);
            part[at + 6u * rs] = dot(q6, k0v);
            part[at + 7u * rs] = dot(q7, k0v);
        }
        if KPL > 1u {
            at = (KG + kg) * PS + lane;
            part[at] = dot(q0, k1v);
            if RB > 1u {
                part[at + rs] = dot(q1, k1v);
            }
            if RB > 2u {
                part[at + 2u * rs] = dot(q2, k1v);
                part[at + 3u * rs] = dot(q3, k1v);
            }
            if RB > 4u {
                part[at + 4u * rs] = dot(q4, k1v);
                part[at + 5u * rs] = dot(q5, k1v);
                part[at + 6u * rs] = dot(q6, k1v);
                part[at + 7u * rs] = dot(q7, k1v);
            }
        }
        if KPL > 2u {
            at = (2u * KG + kg) * PS + lane;
            part[at] = dot(q0, k2v);
            if RB > 1u {
                part[at + rs] = dot(q1, k2v);
            }
            if RB > 2u {
                part[at + 2u * rs] = dot(q2, k2v);
                part[at + 3u * rs] = dot(q3, k2v);
            }
            if RB > 4u {
                part[at + 4u * rs] = dot(q4, k2v);
                part[at + 5u * rs] = dot(q5, k2v);
                part[at + 6u * rs] = dot(q6, k2v);
                part[at + 7u * rs] = dot(q7, k2v);
            }
            at = (3u * KG + kg) * PS + lane;
            part[at] = dot(q0, k3v);
            if RB > 1u {
                part[at + rs] = dot(q1, k3v);
            }
            if RB > 2u {
                part[at + 2u * rs] = dot(q2, k3v);
                part[at + 3u * rs] = dot(q3, k3v);
            }
            if RB > 4u {
                part[at + 4u * rs] = dot(q4, k3v);
                part[at + 5u * rs] = dot(q5, k3v);
                part[at + 6u * rs] = dot(q6, k3v);
                part[at + 7u * rs] = dot(q7, k3v);
            }
        }
        workgroupBarrier();

        // 3. Scores: the partials of (row, key) summed in lane order.
        for (var pair = t; pair < RB * BK; pair += WG) {
            let r = pair / BK;
            let kt = pair % BK;
            var x = 0.0;
            for (var l = 0u; l < LANES; l++) {
                x += part[pair * PS + l];
            }
            scores[pair] = score(x, b, h, len, row0 + r, k0 + kt, key_end);
        }
        workgroupBarrier();

        // 4. The online softmax of each row over the tile.
        if t < RB {
            // NaN and infinite scores weigh 0; the row's code keeps them.
            var tile_max = NEG_BIG;
            for (var kt = 0u; kt < BK; kt++) {
                let x = scores[t * BK + kt];
                if finite_f32(x) {
                    tile_max = max(tile_max, x);
                } else {
                    code = max(code, nonfinite_code(x));
                }
            }
            let row_max_new = max(row_max, tile_max);
            // 1 while the row has seen nothing (NEG_BIG - NEG_BIG), 0 at
            // its first visible key.
            let rescale = exp(row_max - row_max_new);
            var tile_sum = 0.0;
            for (var kt = 0u; kt < BK; kt++) {
                let x = scores[t * BK + kt];
                // Hidden keys get 0 by this test, never by exp(NEG_BIG - m)
                // (on the bits: a NaN may compare either way).
                let seen = bitcast<u32>(x) != bitcast<u32>(NEG_BIG);
                let pv = select(0.0, exp(x - row_max_new), seen && finite_f32(x));
                // A key the row sees whose value is not finite: o = NaN.
                if seen && vbad_any == k0 + 1u && vbad[kt] == k0 + 1u {
                    code = max(code, CODE_VALUE);
                }
                scores[t * BK + kt] = pv;
                tile_sum += pv;
            }
            row_sum = row_sum * rescale + tile_sum;
            row_max = row_max_new;
            stat[t] = rescale;
        }
        workgroupBarrier();

        // 5. acc = acc * rescale + p * v over the lane's keys, in order.
        var pk = kg;
        acc0 = acc0 * stat[0] + scores[pk] * v0v;
        if RB > 1u {
            acc1 = acc1 * stat[1] + scores[BK + pk] * v0v;
        }
        if RB > 2u {
            acc2 = acc2 * stat[2] + scores[2u * BK + pk] * v0v;
            acc3 = acc3 * stat[3] + scores[3u * BK + pk] * v0v;
        }
        if RB > 4u {
            acc4 = acc4 * stat[4] + scores[4u * BK + pk] * v0v;
            acc5 = acc5 * stat[5] + scores[5u * BK + pk] * v0v;
            acc6 = acc6 * stat[6] + scores[6u * BK + pk] * v0v;
            acc7 = acc7 * stat[7] + scores[7u * BK + pk] * v0v;
        }
        if KPL > 1u {
            pk = KG + kg;
            acc0 += scores[pk] * v1v;
            if RB > 1u {
                acc1 += scores[BK + pk] * v1v;
            }
            if RB > 2u {
                acc2 += scores[2u * BK + pk] * v1v;
                acc3 += scores[3u * BK + pk] * v1v;
            }
            if RB > 4u {
                acc4 += scores[4u * BK + pk] * v1v;
                acc5 += scores[5u * BK + pk] * v1v;
                acc6 += scores[6u * BK + pk] * v1v;
                acc7 += scores[7u * BK + pk] * v1v;
            }
        }
        if KPL > 2u {
            pk = 2u * KG + kg;
            acc0 += scores[pk] * v2v;
            if RB > 1u {
                acc1 += scores[BK + pk] * v2v;
            }
            if RB > 2u {
                acc2 += scores[2u * BK + pk] * v2v;
                acc3 += scores[3u * BK + pk] * v2v;
            }
            if RB > 4u {
                acc4 += scores[4u * BK + pk] * v2v;
                acc5 += scores[5u * BK + pk] * v2v;
                acc6 += scores[6u * BK + pk] * v2v;
                acc7 += scores[7u * BK + pk] * v2v;
            }
            pk = 3u * KG + kg;
            acc0 += scores[pk] * v3v;
            if RB > 1u {
                acc1 += scores[BK + pk] * v3v;
            }
            if RB > 2u {
                acc2 += scores[2u * BK + pk] * v3v;
                acc3 += scores[3u * BK + pk] * v3v;
            }
            if RB > 4u {
                acc4 += scores[4u * BK + pk] * v3v;
                acc5 += scores[5u * BK + pk] * v3v;
                acc6 += scores[6u * BK + pk] * v3v;
                acc7 += scores[7u * BK + pk] * v3v;
            }
        }
    }

    // The key groups' accumulators, summed in group order: (kg, row,
    // lane) vec4s through `part` (its last reads were before the last
    // tile's second barrier).
    let ra = LANES * 4u;
    let at = (kg * RB * LANES + lane) * 4u;
    for (var e = 0u; e < 4u; e++) {
        part[at + e] = acc0[e];
        if RB > 1u {
            part[at + ra + e] = acc1[e];
        }
        if RB > 2u {
            part[at + 2u * ra + e] = acc2[e];
            part[at + 3u * ra + e] = acc3[e];
        }
        if RB > 4u {
            part[at + 4u * ra + e] = acc4[e];
            part[at + 5u * ra + e] = acc5[e];
            part[at + 6u * ra + e] = acc6[e];
            part[at + 7u * ra + e] = acc7[e];
        }
    }
    if t < RB {
        stat[8u + t] = row_sum;
        stat[16u + t] = code;
        let r = row0 + t;
        if r < u.rows {
            // lse = row_max + ln(row_sum); -inf (as bits) for a row that
            // saw no key in this split; NaN or +inf for a code.
            var lse = bitcast<f32>(NEG_INF);
            if row_sum > 0.0 {
                lse = row_max + log(row_sum);
            }
            part_lse[(u.split_base + s) * u.out_rows + seq_head * u.rows + r] = bitcast<u32>(code_lse(code, lse));
        }
    }
    workgroupBarrier();
    for (var e = t; e < RB * ra; e += WG) {
        let r = e / ra;
        let col = e % ra;
        if row0 + r < u.rows && col < u.dv {
            var x = 0.0;
            for (var g = 0u; g < KG; g++) {
                x += part[g * RB * ra + e];
            }
            let sum = stat[8u + r];
            // A row that saw no key keeps o = 0; one with a code gets NaN
            // (unless its lse is -inf: no code above 0.5, and no key).
            var o = select(0.0, x / sum, sum > 0.0);
            let code = stat[16u + r];
            if code > 0.75 || (code > 0.0 && sum > 0.0) {
                o = nan_f32();
            }
            part_o[((u.split_base + s) * u.out_rows + seq_head * u.rows + row0 + r) * u.dv + col] = o;
        }
    }
}

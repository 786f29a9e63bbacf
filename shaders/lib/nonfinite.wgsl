// NaN and infinities in the inputs (docs/design.md#non-finite-inputs), for
// every attention kernel and decoding's: prepended before lib/tanh.wgsl.
//
// WGSL does not promise IEEE NaN or infinities in arithmetic (and a
// driver's exp2, min or max may drop a NaN), so they are tested on the
// bits and written as bits, never left to arithmetic to carry:
//
// - an input element that is not finite is replaced by 0 as it is
//   staged for a product, so that a key (or row) a pair hides meets
//   0 * 0, never 0 * NaN; a flag remembers it, and the kernel writes NaN
//   where a pair that sees the element would have read it;
// - a score that is not finite is left out of the online softmax (weight
//   0) and recorded in the row's code: 2 for a NaN, 1 for +inf (-inf
//   only weighs 0); the row's lse is then NaN or +inf and its o NaN;
// - a key the row sees whose value held a NaN or an infinity gives code
//   0.5 (CODE_VALUE): o = NaN, the lse as computed (o = 0 where the lse
//   is -inf, a row of no weight).
// Codes combine by max.

const NONFINITE_NAN: u32 = 0x7fc00000u;
const CODE_VALUE: f32 = 0.5;
const NONFINITE_POS_INF: u32 = 0x7f800000u;

fn nan_f32() -> f32 {
    return bitcast<f32>(NONFINITE_NAN);
}

fn nan4() -> vec4<f32> {
    return vec4(nan_f32());
}

// Flags of non-finite elements for tests over many at once: adding one
// to an exponent field that is all ones (and only then) carries into the
// bit above it, so `(bits & exponent) + one` has bit 31 set (a float32's,
// or the high half of two float16) or bit 15 (the low half) where the
// element is NaN or an infinity. Or the flags of many, test once.
const NONFINITE_FLAGS: u32 = 0x80008000u;

fn flags_f32(x: vec4<f32>) -> u32 {
    let f = (bitcast<vec4<u32>>(x) & vec4(0x7f800000u)) + vec4(0x00800000u);
    return f.x | f.y | f.z | f.w;
}

// Neither NaN nor an infinity, per component.
fn finite4(x: vec4<f32>) -> vec4<bool> {
    return (bitcast<vec4<u32>>(x) & vec4(0x7f800000u)) != vec4(0x7f800000u);
}

fn finite_f32(x: f32) -> bool {
    return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u;
}

fn is_nan_f32(x: f32) -> bool {
    let b = bitcast<u32>(x);
    return (b & 0x7f800000u) == 0x7f800000u && (b & 0x007fffffu) != 0u;
}

// x with every NaN and infinity replaced by 0.
fn clean4(x: vec4<f32>) -> vec4<f32> {
    return select(vec4(0.0), x, finite4(x));
}

// The code of a score: 2 for NaN, 1 for +inf, 0 otherwise (-inf too).
fn nonfinite_code(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    if (b & 0x7f800000u) != 0x7f800000u {
        return 0.0;
    }
    if (b & 0x007fffffu) != 0u {
        return 2.0;
    }
    return select(0.0, 1.0, b == NONFINITE_POS_INF);
}

// The largest code of four scores.
fn nonfinite_code4(x: vec4<f32>) -> f32 {
    return max(max(nonfinite_code(x.x), nonfinite_code(x.y)), max(nonfinite_code(x.z), nonfinite_code(x.w)));
}

// The lse of a row of code `code` whose lse as computed is `lse`: NaN
// (2), +inf (1), else `lse`.
fn code_lse(code: f32, lse: f32) -> f32 {
    if code < 0.75 {
        return lse;
    }
    return bitcast<f32>(select(NONFINITE_POS_INF, NONFINITE_NAN, code > 1.5));
}

// The output element of a row of code `code` from `o` as computed and the
// row's final lse: NaN for a code, except that a row whose lse is -inf
// (no key, or only weight 0) has o = 0.
fn code_out(code: f32, o: f32, lse: f32) -> f32 {
    if code == 0.0 || bitcast<u32>(lse) == 0xff800000u {
        return o;
    }
    return nan_f32();
}

// Float32 bits that send a call to the simple kernels (screen.wgsl): not
// finite, or 2^48 or more in magnitude (exponent 127 + 48), whose
// products, summed over a row, may overflow to an infinity. The host
// tests uploads with the same bits (src/gpu/screen.rs, raises_f32).
const SCREEN_EXPONENT: u32 = 0x57800000u;

fn screened_f32(bits: u32) -> bool {
    return (bits & 0x7f800000u) >= SCREEN_EXPONENT;
}

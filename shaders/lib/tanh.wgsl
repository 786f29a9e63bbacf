// A fragment of every kernel with softcap (after lib/nonfinite.wgsl, before
// lib/common.wgsl, and in decoding's kernel).

// tanh to float32 precision on every driver. The builtin is not: Mesa's
// llvmpipe computes it as (e^2x - 1) / (e^2x + 1), which loses the
// relative precision of small arguments (lse off by ~10 ulps for small
// softcapped scores), and other drivers may use a hardware approximation.
// Below |x| = 0.5 the Taylor series to x^15 is within 2.4e-8 relative;
// above, 1 - 2 / (e^2|x| + 1) loses at most a factor of 2 to cancellation.
// tanh(10) is 1 in float32; the clamp keeps e^2|x| finite.
// tanh(+-inf) = +-1 (the clamp); a NaN stays NaN (min and sign need not
// keep it: lib/nonfinite.wgsl).
fn tanh_f32(x: f32) -> f32 {
    if is_nan_f32(x) {
        return x;
    }
    let a = min(abs(x), 10.0);
    if a < 0.5 {
        let t = x * x;
        var s = -929569.0 / 638512875.0;
        s = s * t + 21844.0 / 6081075.0;
        s = s * t - 1382.0 / 155925.0;
        s = s * t + 62.0 / 2835.0;
        s = s * t - 17.0 / 315.0;
        s = s * t + 2.0 / 15.0;
        s = s * t - 1.0 / 3.0;
        return x + x * (t * s);
    }
    return sign(x) * (1.0 - 2.0 / (exp(2.0 * a) + 1.0));
}

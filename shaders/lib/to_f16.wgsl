// Float32 to float16 as the host rounds (half::f16::from_f32, round to
// nearest even), so that an output rounded on the device has the bits a
// NumPy output has: WGSL's pack2x16float leaves the rounding to the
// implementation, so it is done on the bits. For shaders/device_arrays.wgsl
// (to_f16) and decode/combine_f16.wgsl.

// half::f16::from_f32's software conversion, step for step.
fn f32_to_f16_bits(x: u32) -> u32 {
    let sign = (x & 0x80000000u) >> 16u;
    let exp = x & 0x7f800000u;
    let man = x & 0x007fffffu;
    if exp == 0x7f800000u {
        // Infinity, or NaN kept quiet with its top mantissa bits.
        let nan_bit = select(0x0200u, 0u, man == 0u);
        return sign | 0x7c00u | nan_bit | (man >> 13u);
    }
    let half_exp = i32(exp >> 23u) - 127 + 15;
    if half_exp >= 0x1f {
        return sign | 0x7c00u;
    }
    if half_exp <= 0 {
        if 14 - half_exp > 24 {
            return sign;
        }
        let full = man | 0x00800000u;
        var half_man = full >> u32(14 - half_exp);
        let round_bit = 1u << u32(13 - half_exp);
        if (full & round_bit) != 0u && (full & (3u * round_bit - 1u)) != 0u {
            half_man += 1u;
        }
        return sign | half_man;
    }
    let bits = sign | (u32(half_exp) << 10u) | (man >> 13u);
    let round_bit = 0x00001000u;
    if (man & round_bit) != 0u && (man & (3u * round_bit - 1u)) != 0u {
        return bits + 1u;
    }
    return bits;
}

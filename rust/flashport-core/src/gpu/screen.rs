//! The screen in front of the fast attention kernels (shaders/screen.wgsl).
//!
//! The tiled and cooperative kernels let IEEE arithmetic run over whole
//! tiles, so a NaN or an infinity in a hidden key, or an overflow, reaches
//! rows it must not (`0 * NaN`); following docs/design.md#non-finite-inputs
//! inside them cost 40% of the float16 forward on the H100. Only the simple
//! kernels follow those rules. So a call whose selected kernels are tiled
//! or cooperative records them and, after them, the simple ones built to
//! run behind a pass that reads `q`, `k` and `v` once and raises a flag for
//! any NaN, infinity or float32 value of 2^48 or more (the backward
//! pre-pass raises it for `do`, `o` and `lse`): where it is raised the
//! simple kernels compute every output again, elsewhere each of their
//! workgroups returns at once (shaders/lib/screened.wgsl). The host never
//! waits for the screen, and a call with finite data pays one read of its
//! inputs and two or three empty passes. What the host holds (a float mask,
//! ALiBi slopes, sinks, the scale) it screens itself
//! (`VariantData::screened`) and raises the flag before the work.

use super::context::Context;
use super::pool::Pooled;
use super::transfer::Submission;
use crate::error::Result;

/// Workgroups of the screen: enough to stream the inputs at the device's
/// bandwidth, each invocation reading at least 8 words of each.
const SCREEN_WORKGROUP: u64 = 256;
const SCREEN_MAX_WORKGROUPS: u64 = 8192;

/// The exponent bits from which the screen raises its flag for a float32
/// (2^48, lib/nonfinite.wgsl's `SCREEN_EXPONENT`): NaN and the infinities
/// too.
const SCREEN_EXPONENT: u32 = 0x5780_0000;

/// Whether the float32 words of `bytes` hold a value the screen raises
/// its flag for. `to_device` asks it of every piece it uploads: an array
/// that holds none is marked clean, and a call whose q, k and v all are
/// skips the screen and the simple kernels behind it.
pub(crate) fn raises_f32(bytes: &[u8]) -> bool {
    // Compared as i32 (the masked bits are below 2^31): SSE2 has no
    // unsigned compare.
    words_raise(bytes, |w: i32| (w & 0x7f80_0000) >= SCREEN_EXPONENT as i32)
}

/// As [`raises_f32`] for float16 halves: a NaN or an infinity (float16
/// products cannot overflow float32).
pub(crate) fn raises_f16(bytes: &[u8]) -> bool {
    words_raise(bytes, |h: u16| (h & 0x7c00) == 0x7c00)
}

/// Whether `test` holds for any little-endian word of `bytes`: an OR over
/// aligned words without an early exit, which vectorises (a clean array,
/// the common case, is read whole anyway).
fn words_raise<W: bytemuck::Pod>(bytes: &[u8], test: impl Fn(W) -> bool) -> bool {
    match bytemuck::pod_align_to::<u8, W>(bytes) {
        ([], words, rest) if rest.len() < size_of::<W>() => {
            words.iter().fold(false, |any, &w| any | test(w))
        }
        _ => bytes
            .chunks_exact(size_of::<W>())
            .any(|w| test(bytemuck::pod_read_unaligned(w))),
    }
}

/// Sets the flag, the last word of `buffer`, to whether the host already
/// screened the call out (1) or not (0), before `sub`'s work.
pub(crate) fn reset_flag(ctx: &Context, sub: &mut Submission<'_>, buffer: &Pooled, raised: bool) {
    let at = buffer.bytes() - 4;
    if raised {
        // Written before the submission's commands run.
        ctx.write_buffer(buffer.buffer(), at, &1u32.to_le_bytes());
    } else {
        sub.encoder().clear_buffer(buffer.buffer(), at, Some(4));
    }
}

/// Records the screen of `inputs` (q, k, v as the kernels bind them,
/// float16 pairs where `f16`): raises the last word of `flag`.
pub(crate) fn screen(
    ctx: &Context,
    sub: &mut Submission<'_>,
    f16: bool,
    inputs: [&Pooled; 3],
    flag: &Pooled,
) -> Result<()> {
    let pipeline = ctx.specialised_pipeline(
        "screen",
        || super::shaders::SCREEN.to_string(),
        &[("F16", if f16 { 1.0 } else { 0.0 })],
        false,
    )?;
    let entries: Vec<wgpu::BindGroupEntry<'_>> = inputs
        .into_iter()
        .chain([flag])
        .enumerate()
        .map(|(i, b)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource: b.binding(),
        })
        .collect();
    let group = ctx.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: Some("screen"),
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    });
    let words = inputs.iter().map(|b| b.bytes() / 4).max().unwrap_or(0);
    let groups = words
        .div_ceil(8 * SCREEN_WORKGROUP)
        .clamp(1, SCREEN_MAX_WORKGROUPS) as u32;
    sub.dispatch(&pipeline, &group, (groups, 1), "screen");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host's test is the shader's: the same exponent, so that a
    /// clean mark never skips what the screen would have raised.
    #[test]
    fn the_host_raises_for_what_the_screen_raises() {
        let wgsl = format!("const SCREEN_EXPONENT: u32 = 0x{SCREEN_EXPONENT:08x}u;");
        assert!(super::super::shaders::SCREEN.contains(&wgsl), "{wgsl}");
        let f32s = |x: &[f32]| raises_f32(bytemuck::cast_slice(x));
        let edge = (1u64 << 48) as f32;
        assert!(!f32s(&[
            0.0,
            -1.5,
            2.0e14,
            -edge.next_down(),
            f32::MIN_POSITIVE
        ]));
        for bad in [
            edge,
            -edge,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ] {
            assert!(f32s(&[1.0, 2.0, bad, 3.0]), "{bad}");
        }
        assert!(!f32s(&[]));
        let f16s = |x: &[f32]| {
            let halves: Vec<half::f16> = x.iter().map(|&v| half::f16::from_f32(v)).collect();
            raises_f16(bytemuck::cast_slice(&halves))
        };
        assert!(!f16s(&[0.0, -65504.0, 65504.0, 1e-7]));
        for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e6] {
            assert!(f16s(&[1.0, bad]), "{bad}");
        }
    }
}

//! What every kernel reads besides its arrays: the uniform block `Params`
//! (`struct Params` in shaders' common fragment, checked member by member
//! against this one by the test below) and the variants' data buffer `vx`.

use bytemuck::{Pod, Zeroable};

use super::chunks::Chunk;
use crate::error::{Error, Result};
use crate::problem::Problem;
use crate::variants::{slopes_per_head, AdditiveMask, DropoutMask, VariantArrays};

/// The uniform block of every kernel; the shader's `struct Params` has the
/// same members in the same order (`params_match_the_shader`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Pod, Zeroable)]
pub(crate) struct Params {
    pub seq_q: u32,
    pub seq_k: u32,
    /// Query heads per key/value head.
    pub group: u32,
    /// Index within its GQA group of the first query head bound.
    pub q_head0: u32,
    /// 1 when rows end before seq_k: causal and/or a right window.
    pub causal: u32,
    /// Row i sees keys below i + causal_offset + 1 (with `causal`),
    /// clamped to what cuts the same keys (`offsets` below).
    pub causal_offset: i32,
    pub scale: f32,
    /// Query heads of each key/value head bound in this dispatch.
    pub g_count: u32,
    /// Flat (batch * heads_q + head) index of the first bound query head.
    pub head0: u32,
    pub heads_q: u32,
    /// q_offset - k_offset (by default seq_k - seq_q): the ALiBi distance
    /// is |i + diag_offset - j|. Exact with ALiBi, clamped otherwise.
    pub diag_offset: i32,
    /// Row i sees keys from i + left_offset (with a left window), clamped.
    pub left_offset: i32,
    pub softcap: f32,
    /// 1 / (1 - dropout p).
    pub keep_scale: f32,
    pub drop_threshold: u32,
    pub seed_lo: u32,
    pub seed_hi: u32,
    /// The mask's element strides (0 where it broadcasts) over (batch,
    /// head, row, key), its extents, and its block map's counts.
    pub mask_sb: u32,
    pub mask_sh: u32,
    pub mask_sr: u32,
    pub mask_sk: u32,
    pub mask_db: u32,
    pub mask_dh: u32,
    pub mask_dr: u32,
    pub mask_dk: u32,
    pub mask_bcr: u32,
    pub mask_bck: u32,
    /// Word offsets in `vx` of the block map, the slopes and the sinks.
    pub blocks_off: u32,
    pub slopes_off: u32,
    pub sinks_off: u32,
    /// Word offset in `vx` of a packed batch's row table (`VARLEN`,
    /// `gpu/varlen.rs`).
    pub rows_off: u32,
    /// To 128 bytes, a multiple of the 16-byte uniform alignment.
    pub pad1: u32,
}

impl Params {
    /// The uniform of one chunk of `p`.
    pub fn new(p: &Problem, chunk: &Chunk, vx: &VariantData) -> Params {
        let offsets = Offsets::new(p);
        let dropout = p.dropout.map(DropoutMask::new);
        let m = &vx.mask;
        Params {
            seq_q: p.seq_q as u32,
            seq_k: p.seq_k as u32,
            group: p.group_size() as u32,
            q_head0: chunk.g0 as u32,
            causal: offsets.causal as u32,
            causal_offset: offsets.end,
            scale: p.scale as f32,
            g_count: chunk.g_count as u32,
            head0: chunk.q0(p.group_size()) as u32,
            heads_q: p.heads_q as u32,
            diag_offset: offsets.diagonal,
            left_offset: offsets.start,
            softcap: p.softcap.map_or(1.0, |c| c as f32),
            keep_scale: p.dropout.map_or(1.0, |d| (1.0 / (1.0 - d.p)) as f32),
            drop_threshold: dropout.map_or(0, |d| d.threshold),
            seed_lo: dropout.map_or(0, |d| d.key[0]),
            seed_hi: dropout.map_or(0, |d| d.key[1]),
            mask_sb: m.strides[0],
            mask_sh: m.strides[1],
            mask_sr: m.strides[2],
            mask_sk: m.strides[3],
            mask_db: m.dims[0],
            mask_dh: m.dims[1],
            mask_dr: m.dims[2],
            mask_dk: m.dims[3],
            mask_bcr: m.block_counts[0],
            mask_bck: m.block_counts[1],
            blocks_off: vx.blocks_off,
            slopes_off: vx.slopes_off,
            sinks_off: vx.sinks_off,
            rows_off: vx.rows_off,
            pad1: 0,
        }
    }
}

/// The uniform's three offsets. The kernels add a row (below seq_q) or a
/// key (below seq_k) to them in i32 and clamp the result to the keys or
/// rows there are (shaders/lib/common.wgsl: visible_end, visible_start,
/// rows_seeing_end; the dK/dV kernels' first_row). So an offset past
/// `[-seq_q, seq_k]` shows or hides every key alike and is clamped into it,
/// whatever q_offset and k_offset are, except the diagonal that ALiBi
/// measures distances from, which must be exact (`check_alibi_positions`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Offsets {
    /// Whether rows end before seq_k: causal and/or a right window.
    causal: bool,
    /// Row i sees keys below i + end + 1.
    end: i32,
    /// Row i sees keys from i + start.
    start: i32,
    diagonal: i32,
}

impl Offsets {
    fn new(p: &Problem) -> Offsets {
        let (seq_q, seq_k) = (p.seq_q as i128, p.seq_k as i128);
        let fit = |x: i128| x.clamp(-seq_q, seq_k) as i32;
        let diagonal = p.causal_offset();
        // Row i sees keys up to its diagonal + right (causal: right = 0).
        let right = match (p.causal, p.window.right) {
            (true, _) => Some(0),
            (false, Some(r)) => Some(r as i128),
            (false, None) => None,
        };
        let left = p.window.left.map_or(0, |l| l as i128);
        Offsets {
            causal: right.is_some(),
            end: fit(diagonal + right.unwrap_or(0)),
            start: fit(diagonal - left),
            diagonal: if p.alibi_per_batch.is_some() {
                // Checked to fit by check_alibi_positions.
                diagonal as i32
            } else {
                fit(diagonal)
            },
        }
    }
}

/// With ALiBi the kernels compute `|i + diag_offset - j|` in i32: the
/// diagonal must fit with room for any row and key. Sequences are bounded
/// by `inputs::check_sizes` before; offsets are only bounded by ±2^62.
fn check_alibi_positions(p: &Problem) -> Result<()> {
    let room = i128::from(i32::MAX) - p.seq_q as i128 - p.seq_k as i128;
    if p.alibi_per_batch.is_some() && p.causal_offset().abs() > room {
        return Err(Error::TooLarge(format!(
            "with alibi_slopes the GPU measures distances in 32-bit integers, and \
             q_offset - k_offset = {} (q_offset={}, k_offset={}) is too far from 0 for \
             seq_q={} and seq_k={}; use device=\"cpu\"",
            p.causal_offset(),
            p.q_offset,
            p.k_offset,
            p.seq_q,
            p.seq_k
        )));
    }
    Ok(())
}

/// Where the mask lives in `vx`, as the uniform describes it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MaskWords {
    strides: [u32; 4],
    dims: [u32; 4],
    block_counts: [u32; 2],
}

/// The variant arrays of one call as the kernels read them: the words of
/// `vx` (the mask as float32 bits from 0, its block map from `blocks_off`,
/// ALiBi slopes per flat query head from `slopes_off`, sinks per query
/// head from `sinks_off`, a packed batch's row table from `rows_off`) and
/// the mask's layout.
pub(crate) struct VariantData {
    pub words: Vec<u32>,
    mask: MaskWords,
    blocks_off: u32,
    slopes_off: u32,
    sinks_off: u32,
    rows_off: u32,
}

impl VariantData {
    pub fn new(p: &Problem, arrays: &VariantArrays<'_>) -> Result<VariantData> {
        arrays.check(p)?;
        check_alibi_positions(p)?;
        let mut words: Vec<u32> = Vec::new();
        let mut mask = MaskWords::default();
        let mut blocks_off = 0;
        if let Some(data) = arrays.mask {
            let additive = AdditiveMask::<f32>::new(p, data)
                .ok_or_else(|| Error::Shape("mask data without a validated mask".to_string()))?;
            // -inf stays -inf: the kernels test its bits to hide the key.
            words.extend(additive.values.iter().map(|x| x.to_bits()));
            blocks_off = words.len() as u32;
            words.extend(additive.blocks.iter().map(|&b| u32::from(b)));
            mask = MaskWords {
                strides: additive.strides.map(|s| s as u32),
                dims: additive.dims.map(|d| d as u32),
                block_counts: additive.block_counts.map(|c| c as u32),
            };
        }
        let slopes_off = words.len() as u32;
        if let Some(slopes) = arrays.alibi_slopes {
            let per_head = slopes_per_head(p, slopes);
            words.extend(per_head.iter().map(|&s| (s as f32).to_bits()));
        }
        let sinks_off = words.len() as u32;
        if let Some(sinks) = arrays.sinks {
            words.extend(sinks.iter().map(|&s| (s as f32).to_bits()));
        }
        let rows_off = words.len() as u32;
        if let Some(segments) = arrays.segments {
            words.extend(super::varlen::table_words(p, segments));
        }
        Ok(VariantData {
            words,
            mask,
            blocks_off,
            slopes_off,
            sinks_off,
            rows_off,
        })
    }

    /// The sink logits per query head, as the kernels read them.
    pub fn sinks(&self, p: &Problem) -> Option<Vec<f32>> {
        let at = self.sinks_off as usize;
        p.sinks.then(|| {
            self.words[at..at + p.heads_q]
                .iter()
                .map(|&w| f32::from_bits(w))
                .collect()
        })
    }

    /// Whether what the host holds sends the call to the simple kernels
    /// (src/gpu/screen.rs): a NaN or a value of 2^48 or more in a float
    /// mask (its -inf hides a key; a very negative value only lowers a
    /// score), ALiBi slopes or sinks that are not finite or are that
    /// large, or such a scale or softcap.
    pub fn screened(&self, p: &Problem) -> bool {
        const SCREEN: f64 = (1u64 << 48) as f64;
        let huge = |x: f64| x.is_nan() || x.abs() >= SCREEN;
        let floats = |from: u32, to: u32| {
            self.words[from as usize..to as usize]
                .iter()
                .map(|&w| f32::from_bits(w) as f64)
        };
        let mask_end = if p.mask.is_some() { self.blocks_off } else { 0 };
        floats(0, mask_end).any(|m| m.is_nan() || m >= SCREEN)
            || floats(self.slopes_off, self.rows_off).any(huge)
            || huge(p.scale)
            || p.softcap.is_some_and(huge)
    }

    /// The words to upload: a one-word dummy when the call has no variant
    /// arrays (the kernels name `vx` in code their overrides switch off,
    /// and every binding a pipeline names must be bound).
    pub fn upload_words(&self) -> &[u32] {
        if self.words.is_empty() {
            &[0]
        } else {
            &self.words
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};
    use wgpu::naga;

    fn problem(seq_q: usize, seq_k: usize, options: crate::problem::Options<'_>) -> Problem {
        crate::problem::validate_forward(
            crate::problem::ArrayInfo::new(&[seq_q, 4][..], "float32"),
            crate::problem::ArrayInfo::new(&[seq_k, 4][..], "float32"),
            crate::problem::ArrayInfo::new(&[seq_k, 4][..], "float32"),
            &options,
        )
        .unwrap()
    }

    /// What the host screens (src/gpu/screen.rs): a float mask's NaN, +inf
    /// or value of 2^48 or more, but not its -inf or very negative values
    /// (they hide or lower a key); slopes and sinks that are not finite or
    /// that large; such a scale.
    #[test]
    fn the_host_screens_what_it_holds() {
        let (mask_info, one) = ([6usize, 10], [1usize]);
        let screened = |mask: Option<&[f32]>, sinks: Option<f64>, slope: Option<f64>, scale| {
            let options = crate::problem::Options::from(crate::problem::VariantOptions {
                mask: mask.map(|_| crate::problem::ArrayInfo::new(&mask_info, "float32")),
                sinks: sinks.map(|_| crate::problem::ArrayInfo::new(&one, "float32")),
                alibi_slopes: slope.map(|_| crate::problem::ArrayInfo::new(&one, "float32")),
                scale,
                ..Default::default()
            });
            let p = problem(6, 10, options);
            let (sinks, slopes) = (sinks.map(|s| [s]), slope.map(|s| [s]));
            let arrays = crate::variants::VariantArrays {
                mask: mask.map(|m| crate::variants::MaskData::Float(crate::array::Slice::F32(m))),
                sinks: sinks.as_ref().map(|s| &s[..]),
                alibi_slopes: slopes.as_ref().map(|s| &s[..]),
                segments: None,
            };
            VariantData::new(&p, &arrays).unwrap().screened(&p)
        };
        let mask = |x: f32| {
            let mut m = vec![0.25f32; 60];
            m[17] = x;
            m
        };
        assert!(!screened(None, None, None, None));
        for x in [f32::NEG_INFINITY, -3.0e38, 1.0e14] {
            assert!(!screened(Some(&mask(x)), None, None, None), "{x}");
        }
        for x in [f32::NAN, f32::INFINITY, 3.0e14] {
            assert!(screened(Some(&mask(x)), None, None, None), "{x}");
        }
        for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e20] {
            assert!(screened(None, Some(x), None, None), "sink {x}");
            assert!(screened(None, None, Some(x), None), "slope {x}");
        }
        assert!(!screened(None, Some(-3.0), Some(0.5), Some(0.1)));
        assert!(screened(None, None, None, Some(1e20)));
    }

    /// With the default positions the offsets are those the uniform held
    /// before positions existed (seq_k - seq_q, plus the right bound
    /// clamped to seq_q, minus the left one clamped to seq_k).
    #[test]
    fn default_offsets_are_the_bottom_right_ones() {
        for (seq_q, seq_k) in [(5, 9), (9, 5), (7, 7), (1, 300)] {
            for window in [None, Some((2, 3)), Some((500, 500)), Some((0, -1))] {
                for causal in [false, true] {
                    let options = crate::problem::Options::from(crate::problem::VariantOptions {
                        causal,
                        window,
                        ..Default::default()
                    });
                    let p = problem(seq_q, seq_k, options);
                    let off = seq_k as i64 - seq_q as i64;
                    let right = match (causal, p.window.right) {
                        (true, _) => Some(0),
                        (false, r) => r.map(|r| r.min(seq_q) as i64),
                    };
                    let left = p.window.left.map_or(0, |l| l.min(seq_k) as i64);
                    let o = Offsets::new(&p);
                    assert_eq!(
                        (o.causal, o.end, o.start, o.diagonal),
                        (
                            right.is_some(),
                            (off + right.unwrap_or(0)) as i32,
                            (off - left) as i32,
                            off as i32
                        ),
                        "{p:?}"
                    );
                }
            }
        }
    }

    /// Offsets far apart are clamped to [-seq_q, seq_k], where they hide
    /// or show every key as the exact ones do; with ALiBi the diagonal
    /// must fit instead.
    #[test]
    fn far_offsets_are_clamped_except_for_alibi() {
        let far = |q_offset: i128, k_offset: i128, alibi: bool| {
            let slopes = [1usize];
            let options = crate::problem::Options::from(crate::problem::VariantOptions {
                causal: true,
                window: Some((3, -1)),
                q_offset: Some(q_offset),
                k_offset: Some(k_offset),
                alibi_slopes: alibi.then(|| crate::problem::ArrayInfo::new(&slopes, "float32")),
                ..Default::default()
            });
            problem(6, 10, options)
        };
        let p = far(1 << 62, -(1 << 62), false);
        let o = Offsets::new(&p);
        assert_eq!((o.end, o.start, o.diagonal), (10, 10, 10));
        assert!(check_alibi_positions(&p).is_ok());
        let p = far(-(1 << 40), 1 << 40, false);
        let o = Offsets::new(&p);
        assert_eq!((o.end, o.start, o.diagonal), (-6, -6, -6));
        let p = far(1 << 40, 0, true);
        assert!(matches!(check_alibi_positions(&p), Err(Error::TooLarge(_))));
        let p = far(1_000_000 + 7, 1_000_000, true);
        assert!(check_alibi_positions(&p).is_ok());
        assert_eq!(Offsets::new(&p).diagonal, 7);
    }

    /// Every member of the shader's `struct Params`, in order, at the
    /// offset of the member of the same name here, and the same size: a
    /// member added, dropped or moved on one side only fails here instead
    /// of giving one variant silently wrong answers.
    #[test]
    fn params_match_the_shader() {
        let module = naga::front::wgsl::parse_str(super::super::shaders::COMMON)
            .expect("the common fragment parses");
        let (span, members) = module
            .types
            .iter()
            .find_map(|(_, ty)| match (&ty.name, &ty.inner) {
                (Some(name), naga::TypeInner::Struct { members, span }) if name == "Params" => {
                    Some((*span, members.clone()))
                }
                _ => None,
            })
            .expect("struct Params in the common fragment");
        macro_rules! offsets {
            ($($field:ident),* $(,)?) => {
                [$((stringify!($field), offset_of!(Params, $field))),*]
            };
        }
        let rust = offsets!(
            seq_q,
            seq_k,
            group,
            q_head0,
            causal,
            causal_offset,
            scale,
            g_count,
            head0,
            heads_q,
            diag_offset,
            left_offset,
            softcap,
            keep_scale,
            drop_threshold,
            seed_lo,
            seed_hi,
            mask_sb,
            mask_sh,
            mask_sr,
            mask_sk,
            mask_db,
            mask_dh,
            mask_dr,
            mask_dk,
            mask_bcr,
            mask_bck,
            blocks_off,
            slopes_off,
            sinks_off,
            rows_off,
            pad1,
        );
        let shader: Vec<(String, usize)> = members
            .iter()
            .map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize))
            .collect();
        let rust: Vec<(String, usize)> = rust.iter().map(|(n, o)| (n.to_string(), *o)).collect();
        assert_eq!(shader, rust);
        assert_eq!(span as usize, size_of::<Params>());
        // Every field of the Rust struct is in the list above: its members
        // account for all of its bytes (all are four bytes wide).
        assert_eq!(4 * rust.len(), size_of::<Params>());
    }
}

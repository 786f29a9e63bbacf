//! What every kernel reads besides its arrays: the uniform block `Params`
//! (`struct Params` in shaders' common fragment, checked member by member
//! against this one by the test below) and the variants' data buffer `vx`.

use bytemuck::{Pod, Zeroable};

use super::chunks::Chunk;
use crate::variants::{slopes_per_head, AdditiveMask, DropoutMask};
use crate::{Error, Problem, Result, VariantArrays};

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
    /// Row i sees keys below i + causal_offset + 1 (with `causal`).
    pub causal_offset: i32,
    pub scale: f32,
    /// Query heads of each key/value head bound in this dispatch.
    pub g_count: u32,
    /// Flat (batch * heads_q + head) index of the first bound query head.
    pub head0: u32,
    pub heads_q: u32,
    /// seq_k - seq_q: the ALiBi distance is |i + diag_offset - j|.
    pub diag_offset: i32,
    /// Row i sees keys from i + left_offset (with a left window).
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
    /// To 128 bytes, a multiple of the 16-byte uniform alignment.
    pub pad0: u32,
    pub pad1: u32,
}

impl Params {
    /// The uniform of one chunk of `p`.
    pub fn new(p: &Problem, chunk: &Chunk, vx: &VariantData) -> Params {
        let off = p.causal_offset() as i64;
        // Row i sees keys up to i + off + right (causal: right = 0). A
        // right bound of seq_q or more cuts nothing, so larger ones are
        // clamped to keep the sums in i32 (the sequences are bounded
        // before any kernel runs).
        let right = match (p.causal, p.window.right) {
            (true, _) => Some(0),
            (false, Some(r)) => Some(r.min(p.seq_q) as i64),
            (false, None) => None,
        };
        let left = p.window.left.map_or(0, |l| l.min(p.seq_k) as i64);
        let dropout = p.dropout.map(DropoutMask::new);
        let m = &vx.mask;
        Params {
            seq_q: p.seq_q as u32,
            seq_k: p.seq_k as u32,
            group: p.group_size() as u32,
            q_head0: chunk.g0 as u32,
            causal: right.is_some() as u32,
            causal_offset: (off + right.unwrap_or(0)) as i32,
            scale: p.scale as f32,
            g_count: chunk.g_count as u32,
            head0: chunk.q0(p.group_size()) as u32,
            heads_q: p.heads_q as u32,
            diag_offset: off as i32,
            left_offset: (off - left) as i32,
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
            pad0: 0,
            pad1: 0,
        }
    }
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
/// head from `sinks_off`) and the mask's layout.
pub(crate) struct VariantData {
    pub words: Vec<u32>,
    mask: MaskWords,
    blocks_off: u32,
    slopes_off: u32,
    sinks_off: u32,
}

impl VariantData {
    pub fn new(p: &Problem, arrays: &VariantArrays<'_>) -> Result<VariantData> {
        arrays.check(p)?;
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
        Ok(VariantData {
            words,
            mask,
            blocks_off,
            slopes_off,
            sinks_off,
        })
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
            pad0,
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

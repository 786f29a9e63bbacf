//! A submission's small parameters (its kernels' uniforms, a decode call's
//! lengths and block table, a scatter's slots) packed into one device
//! buffer, filled through one staging buffer by one copy: a decode step's
//! calls each made three or four uploads of their own (a staging buffer
//! taken, mapped, unmapped, copied from and mapped again, a device buffer
//! taken and tracked), host work that showed in the profile of a 32-layer
//! decode step on the H200 (docs/gpu.md#host-transfers).
//!
//! The copy is recorded when the arena is opened, before any dispatch
//! that reads it, and covers the whole arena; the bytes reach the staging
//! buffer when the submission is sealed, just before it is submitted (the
//! GPU reads them only then). A parameter too large for an arena is an
//! upload of its own.

use std::sync::Arc;

use super::context::Context;
use super::pool::{padded, Pooled};
use crate::error::{Error, Result};

/// Bytes of one arena: a decode call's parameters (two uniforms of under
/// 128 bytes, its lengths and a block table: 8 sequences of 4096 keys in
/// blocks of 16 are 8 KiB), or a KV cache append's (two uniforms, the
/// slots of a batch's positions). The GPU copies the whole arena, a few
/// microseconds' fraction.
pub(crate) const ARENA_BYTES: u64 = 64 << 10;

/// The largest parameter packed into an arena; larger ones are uploaded
/// on their own (a long block table, a mask).
pub(crate) const INLINE_BYTES: u64 = 32 << 10;

// Every parameter packed fits an empty arena (`Submission::param`).
const _: () = assert!(INLINE_BYTES <= ARENA_BYTES);

/// One parameter: a range of a device buffer, bound as a uniform or a
/// storage array.
#[derive(Clone)]
pub(crate) struct Param {
    buffer: Arc<Pooled>,
    offset: u64,
    size: u64,
}

impl Param {
    /// A whole buffer of its own.
    pub fn whole(buffer: Arc<Pooled>) -> Self {
        let size = buffer.bytes();
        Param {
            buffer,
            offset: 0,
            size,
        }
    }

    /// The device buffer, and where in it the parameter lies (bytes).
    #[cfg(feature = "testing")]
    pub fn range(&self) -> (&Pooled, u64, u64) {
        (&self.buffer, self.offset, self.size)
    }

    pub fn binding(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: self.buffer.buffer(),
            offset: self.offset,
            size: wgpu::BufferSize::new(self.size),
        })
    }
}

/// An open arena: its device buffer, the mapped staging buffer it is
/// copied from, and the bytes written so far.
pub(crate) struct Arena {
    device: Arc<Pooled>,
    staging: wgpu::Buffer,
    bytes: Vec<u8>,
}

/// Offsets of parameters in an arena: what both a uniform and a storage
/// binding accept on this adapter.
pub(crate) fn alignment(ctx: &Context) -> u64 {
    let l = &ctx.limits;
    (l.min_uniform_buffer_offset_alignment)
        .max(l.min_storage_buffer_offset_alignment)
        .max(16) as u64
}

/// Where `len` bytes go in an arena of which `used` bytes are taken: the
/// offset (aligned) and the size (padded to words), or `None` past the end.
fn place(used: u64, len: u64, align: u64) -> Option<(u64, u64)> {
    let offset = used.next_multiple_of(align);
    let size = padded(len);
    (offset + size <= ARENA_BYTES).then_some((offset, size))
}

impl Arena {
    /// An arena whose copy `encoder` records now (`device` comes from the
    /// submission, which keeps it until its work is done).
    pub fn open(ctx: &Context, device: Arc<Pooled>, encoder: &mut wgpu::CommandEncoder) -> Self {
        let staging = ctx.take_upload_staging(ARENA_BYTES);
        encoder.copy_buffer_to_buffer(&staging, 0, device.buffer(), 0, ARENA_BYTES);
        Arena {
            device,
            staging,
            bytes: Vec::with_capacity(1024),
        }
    }

    /// `bytes` at the next offset aligned to `align`, or `None` where they
    /// do not fit.
    pub fn push(&mut self, bytes: &[u8], align: u64) -> Option<Param> {
        let (offset, size) = place(self.bytes.len() as u64, bytes.len() as u64, align)?;
        self.bytes.resize(offset as usize, 0);
        self.bytes.extend_from_slice(bytes);
        self.bytes.resize((offset + size) as usize, 0);
        Some(Param {
            buffer: self.device.clone(),
            offset,
            size,
        })
    }

    /// Writes the bytes into the staging buffer and unmaps it: the
    /// submission may go to the GPU now. Returns the staging buffer, to be
    /// recycled once submitted.
    pub fn seal(self) -> Result<wgpu::Buffer> {
        {
            let n = self.bytes.len() as u64;
            if n > 0 {
                let mut view = self
                    .staging
                    .slice(..n)
                    .get_mapped_range_mut()
                    .map_err(|e| {
                        Error::Gpu(format!("could not map the upload buffer of params: {e}"))
                    })?;
                view.copy_from_slice(&self.bytes);
            }
        }
        self.staging.unmap();
        Ok(self.staging)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameters_are_aligned_padded_and_bounded() {
        assert_eq!(place(0, 96, 256), Some((0, 96)));
        assert_eq!(place(96, 10, 256), Some((256, 12)));
        assert_eq!(place(100, 0, 16), Some((112, 4)));
        let last = ARENA_BYTES - 256;
        assert_eq!(place(last, 256, 256), Some((last, 256)));
        assert_eq!(place(last + 1, 4, 256), None);
        assert_eq!(place(0, ARENA_BYTES + 1, 16), None);
    }
}

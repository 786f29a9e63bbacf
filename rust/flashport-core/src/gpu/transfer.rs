//! Moving bytes between the host and the GPU: uploads through reused
//! mapped staging buffers, output buffers (poisoned with NaN where asked),
//! and readbacks of several outputs through one mappable buffer.

use std::sync::mpsc;

use super::context::Context;
use super::timing::record_host;
use crate::{Error, Result};

/// Buffer sizes are multiples of 4 bytes, and never 0.
pub(crate) fn padded(bytes: u64) -> u64 {
    bytes.max(4).next_multiple_of(4)
}

pub(crate) fn upload(ctx: &Context, label: &str, bytes: &[u8]) -> Result<wgpu::Buffer> {
    upload_as(ctx, label, bytes, wgpu::BufferUsages::STORAGE)
}

/// Uploads `bytes` into a new buffer of `usage` (plus COPY_DST); the copy
/// is submitted before any later work.
pub(crate) fn upload_as(
    ctx: &Context,
    label: &str,
    bytes: &[u8],
    usage: wgpu::BufferUsages,
) -> Result<wgpu::Buffer> {
    let size = padded(bytes.len() as u64);
    let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage: usage | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let staging = ctx.take_upload_staging(size);
    {
        let mut view = staging
            .slice(..size)
            .get_mapped_range_mut()
            .map_err(|e| Error::Gpu(format!("could not map the upload buffer {label}: {e}")))?;
        parallel_copy(view.slice(..bytes.len()), bytes);
        // A reused staging buffer holds an earlier upload: the padding
        // after the data must not carry it over.
        view.slice(bytes.len()..).fill(0);
    }
    staging.unmap();
    let mut encoder = ctx
        .device
        .create_command_encoder(&wgpu::CommandEncoderDescriptor {
            label: Some("flashport upload"),
        });
    encoder.copy_buffer_to_buffer(&staging, 0, &buffer, 0, size);
    // Submissions run in order, so the kernels submitted after this see the
    // data.
    ctx.queue.submit([encoder.finish()]);
    ctx.recycle_upload_staging(staging);
    Ok(buffer)
}

/// Bytes per task of the host copies into and out of mapped GPU memory:
/// large arrays are copied by several threads, which also spreads the
/// first-touch page faults of fresh host buffers.
const COPY_CHUNK: usize = 4 << 20;

fn parallel_copy(mut dst: wgpu::WriteOnly<'_, [u8]>, src: &[u8]) {
    use rayon::prelude::*;
    /// The mapped destination, shared by the copying threads.
    struct Destination(*mut u8);
    // SAFETY: each thread writes its own disjoint chunk (below).
    unsafe impl Sync for Destination {}
    assert_eq!(dst.len(), src.len(), "upload of the wrong size");
    let destination = Destination(dst.as_raw_ptr().as_ptr() as *mut u8);
    src.par_chunks(COPY_CHUNK)
        .enumerate()
        .for_each(|(i, chunk)| {
            let destination = &destination;
            // SAFETY: `dst` is valid for `src.len()` bytes of writes while it
            // is borrowed here, and the chunks are disjoint.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    chunk.as_ptr(),
                    destination.0.add(i * COPY_CHUNK),
                    chunk.len(),
                )
            }
        });
}

/// Whether output buffers are filled with NaN before the kernels run: in
/// debug builds (the Rust tests) and with `FLASHPORT_GPU_POISON=1` (the
/// Python test suite sets it), so that an unwritten element cannot pass for
/// a result. Off otherwise: it costs an upload of every output.
fn poison_outputs() -> bool {
    cfg!(debug_assertions) || std::env::var("FLASHPORT_GPU_POISON").as_deref() == Ok("1")
}

/// A new float32 output buffer of `floats` elements, poisoned where asked.
pub(crate) fn output(ctx: &Context, label: &str, floats: usize) -> wgpu::Buffer {
    let buffer = ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size: padded(4 * floats as u64),
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    if poison_outputs() && floats > 0 {
        // Poison: an element a kernel forgets to write reads back as NaN.
        let nan = vec![f32::NAN; floats];
        ctx.queue
            .write_buffer(&buffer, 0, bytemuck::cast_slice(&nan));
    }
    buffer
}

/// A one-word buffer for a read-write binding a pipeline names but this
/// call does not use.
pub(crate) fn dummy_output(ctx: &Context) -> wgpu::Buffer {
    ctx.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("unused"),
        size: 4,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    })
}

/// Copies `outputs` (buffer, f32 words each) into one mappable buffer,
/// submits `encoder`, waits, and returns each output's words.
pub(crate) fn read_back(
    ctx: &Context,
    mut encoder: wgpu::CommandEncoder,
    outputs: &[(&wgpu::Buffer, usize)],
) -> Result<Vec<Vec<f32>>> {
    let mut offsets = Vec::with_capacity(outputs.len());
    let mut total = 0u64;
    for (buffer, _) in outputs {
        offsets.push(total);
        total += buffer.size();
    }
    let staging = ctx.take_readback_buffer(total.max(4));
    for ((buffer, _), &offset) in outputs.iter().zip(&offsets) {
        encoder.copy_buffer_to_buffer(buffer, 0, &staging, offset, buffer.size());
    }
    let t_submit = std::time::Instant::now();
    let index = ctx.queue.submit([encoder.finish()]);
    let (tx, rx) = mpsc::channel();
    staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    let wait = ctx.device.poll(wgpu::PollType::Wait {
        submission_index: Some(index),
        timeout: None,
    });
    if let Err(e) = wait {
        return Err(Error::Gpu(format!(
            "waiting for the GPU failed on {}: {e}",
            ctx.adapter.name
        )));
    }
    // The wait above runs the callbacks of finished work; the loop only
    // covers a map that another thread's poll has not delivered yet.
    let mapped = loop {
        match rx.try_recv() {
            Ok(r) => break r,
            Err(mpsc::TryRecvError::Empty) => {
                if ctx.is_lost() {
                    return Err(Error::Gpu(format!(
                        "the GPU device {} was lost",
                        ctx.adapter.name
                    )));
                }
                ctx.device
                    .poll(wgpu::PollType::wait_indefinitely())
                    .map_err(|e| Error::Gpu(format!("waiting for the GPU failed: {e}")))?;
                std::thread::yield_now();
            }
            Err(mpsc::TryRecvError::Disconnected) => {
                return Err(Error::Gpu(
                    "the readback buffer was never mapped".to_string(),
                ))
            }
        }
    };
    mapped.map_err(|e| {
        Error::Gpu(format!(
            "could not read the results back from {}: {e}",
            ctx.adapter.name
        ))
    })?;
    record_host("submit_and_wait", t_submit);
    let t_copy = std::time::Instant::now();
    let view = staging
        .slice(..)
        .get_mapped_range()
        .map_err(|e| Error::Gpu(format!("could not read the results back: {e}")))?;
    let results = outputs
        .iter()
        .zip(&offsets)
        .map(|((_, floats), &offset)| {
            let start = offset as usize;
            let bytes = &view[start..start + 4 * floats];
            match bytemuck::try_cast_slice::<u8, f32>(bytes) {
                // Collected in parallel straight into the result, without
                // zeroing it first.
                Ok(values) => {
                    use rayon::prelude::*;
                    values.par_iter().copied().collect()
                }
                Err(_) => bytemuck::pod_collect_to_vec::<u8, f32>(bytes),
            }
        })
        .collect();
    drop(view);
    staging.unmap();
    ctx.return_readback_buffer(staging);
    record_host("readback_copy", t_copy);
    Ok(results)
}

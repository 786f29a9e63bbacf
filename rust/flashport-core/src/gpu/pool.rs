//! Buffers kept between calls, so that a call allocates (and frees) no
//! memory once the shapes repeat:
//! - device-local buffers ([`DevicePool`]): every output, device array,
//!   uploaded input and temporary of a call. On NVIDIA's Vulkan driver a
//!   buffer of tens of MiB is a memory allocation of its own, and creating
//!   and destroying the outputs of every call cost milliseconds.
//! - mapped staging buffers for uploads, the small ones too (wgpu's
//!   `Queue::write_buffer` stages every write through a fresh host-visible
//!   allocation: on the H100, once large staging buffers were kept, the two
//!   small writes of a call's parameters cost 2–3 ms in memory
//!   allocations; and a fresh large host buffer's first touch cost more
//!   than the copy) and mappable buffers for readbacks (allocating and
//!   first touching a fresh host buffer of the outputs' size cost more than
//!   copying out of it).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::runtime::lock;

/// The usages of every device-local buffer: bound by the kernels (a call's
/// parameters as a uniform), copied from (readbacks, chunks) and into
/// (uploads, chunk results).
pub(crate) const DEVICE_USAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::UNIFORM)
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);

/// Buffer sizes are multiples of 4 bytes, and never 0.
pub(crate) fn padded(bytes: u64) -> u64 {
    bytes.max(4).next_multiple_of(4)
}

/// The size a buffer for `bytes` is created with: the next of 8 steps per
/// power of two (at most 12.5% more), so that calls whose sizes differ a
/// little share buffers. Multiples of 4 bytes, never 0.
pub(crate) fn bucket(bytes: u64) -> u64 {
    let bytes = padded(bytes);
    if bytes <= 1024 {
        return bytes.next_multiple_of(64);
    }
    let step = 1u64 << (63 - bytes.leading_zeros() - 3);
    bytes.next_multiple_of(step)
}

/// Device-local buffers that calls no longer use, by size, kept for the
/// next call that needs one of that size. The free ones hold at most
/// `max_bytes` in all; the oldest go first.
struct DevicePool {
    free: Mutex<VecDeque<wgpu::Buffer>>,
    max_bytes: u64,
}

impl DevicePool {
    fn new(max_bytes: u64) -> Self {
        DevicePool {
            free: Default::default(),
            max_bytes,
        }
    }

    /// A free buffer of `bucket(bytes)`, or a new one.
    fn take(&self, device: &wgpu::Device, bytes: u64) -> wgpu::Buffer {
        let size = bucket(bytes);
        let mut free = lock(&self.free);
        if let Some(i) = free.iter().position(|b| b.size() == size) {
            if let Some(buffer) = free.remove(i) {
                return buffer;
            }
        }
        drop(free);
        device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("flashport"),
            size,
            usage: DEVICE_USAGE,
            mapped_at_creation: false,
        })
    }

    fn give(&self, buffer: wgpu::Buffer) {
        if buffer.size() > self.max_bytes {
            return;
        }
        let mut free = lock(&self.free);
        free.push_back(buffer);
        let mut total: u64 = free.iter().map(wgpu::Buffer::size).sum();
        while total > self.max_bytes {
            match free.pop_front() {
                Some(oldest) => total -= oldest.size(),
                None => break,
            }
        }
    }
}

/// A device-local buffer of the pool holding `bytes` bytes (the buffer
/// itself may be larger: bind it with [`Pooled::binding`]). It goes back to
/// the pool when dropped, so it must outlive the recording of every
/// submission that uses it: a call keeps its temporaries until its work is
/// submitted. Only later submissions can take it from the pool then, and
/// the queue runs them after the work that used it (`transfer.rs`).
pub(crate) struct Pooled {
    buffer: wgpu::Buffer,
    bytes: u64,
    /// `None` for a buffer of its own ([`Pools::owned_buffer`]).
    pool: Option<Arc<DevicePool>>,
}

impl Pooled {
    pub fn buffer(&self) -> &wgpu::Buffer {
        &self.buffer
    }

    /// Bytes in use (a multiple of 4).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The binding of the bytes in use.
    pub fn binding(&self) -> wgpu::BindingResource<'_> {
        wgpu::BindingResource::Buffer(wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: 0,
            size: wgpu::BufferSize::new(self.bytes),
        })
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.give(self.buffer.clone());
        }
    }
}

/// Host-visible buffers kept between calls for reuse, by size (`bucket`),
/// within bounds on their count, the largest one kept and the bytes held
/// in all (the oldest go first): bounds the host memory a finished call
/// leaves behind.
#[derive(Clone)]
struct BufferPool {
    buffers: Arc<Mutex<VecDeque<wgpu::Buffer>>>,
    max_buffers: usize,
    max_buffer_bytes: u64,
    max_total_bytes: u64,
}

impl BufferPool {
    fn new(max_buffers: usize, max_buffer_bytes: u64, max_total_bytes: u64) -> Self {
        BufferPool {
            buffers: Default::default(),
            max_buffers,
            max_buffer_bytes,
            max_total_bytes,
        }
    }

    /// A kept buffer of `bucket(size)` bytes, or `create(bucket(size))`.
    fn take(&self, size: u64, create: impl FnOnce(u64) -> wgpu::Buffer) -> wgpu::Buffer {
        let size = bucket(size);
        let mut pool = lock(&self.buffers);
        match pool.iter().position(|b| b.size() == size) {
            Some(i) => pool.remove(i).unwrap_or_else(|| create(size)),
            None => create(size),
        }
    }

    /// Keeps `buffer`, dropping the oldest kept ones while over bounds.
    fn keep(&self, buffer: wgpu::Buffer) {
        if buffer.size() > self.max_buffer_bytes {
            return;
        }
        let mut pool = lock(&self.buffers);
        pool.push_back(buffer);
        while pool.len() > self.max_buffers
            || pool.iter().map(wgpu::Buffer::size).sum::<u64>() > self.max_total_bytes
        {
            if pool.pop_front().is_none() {
                break;
            }
        }
    }
}

/// A context's pools: device-local buffers, upload staging buffers and
/// readback buffers, each kept between calls. The pools know nothing of
/// the context: each call that makes a buffer is given the device.
pub(crate) struct Pools {
    /// Mappable buffers of earlier calls' readbacks.
    readback: BufferPool,
    /// Mapped staging buffers for uploads, remapped after each use.
    upload: BufferPool,
    /// Device-local buffers calls no longer use.
    device_local: Arc<DevicePool>,
}

impl Pools {
    pub fn new() -> Self {
        Pools {
            // A call's outputs read back through one buffer; its inputs
            // upload through one each (up to six, plus the parameters).
            readback: BufferPool::new(2, 256 << 20, 512 << 20),
            upload: BufferPool::new(32, 256 << 20, 512 << 20),
            // Enough for the outputs and temporaries of a forward and
            // backward of (4, 16, 4096, 128) float32 several times over.
            device_local: Arc::new(DevicePool::new(2 << 30)),
        }
    }

    /// A device-local buffer for `bytes` bytes (rounded up to 4), from the
    /// pool where one of its size is free. Its contents are whatever an
    /// earlier call left: every user writes it before reading.
    pub fn device_buffer(&self, device: &wgpu::Device, bytes: u64) -> Pooled {
        let bytes = padded(bytes);
        Pooled {
            buffer: self.device_local.take(device, bytes),
            bytes,
            pool: Some(self.device_local.clone()),
        }
    }

    /// A device-local buffer of exactly `bytes` (rounded up to 4), outside
    /// the pool: a KV cache's pools live as long as the cache, sized to it
    /// rather than to a bucket, and are freed with it. Zeroed by wgpu.
    pub fn owned_buffer(device: &wgpu::Device, bytes: u64) -> Pooled {
        let bytes = padded(bytes);
        Pooled {
            buffer: device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("flashport kv cache"),
                size: bytes,
                usage: DEVICE_USAGE,
                mapped_at_creation: false,
            }),
            bytes,
            pool: None,
        }
    }

    /// A mapped MAP_WRITE | COPY_SRC buffer of at least `size` bytes: a
    /// kept one of its bucket, or a new one.
    pub fn take_upload_staging(&self, device: &wgpu::Device, size: u64) -> wgpu::Buffer {
        self.upload.take(size, |size| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("flashport upload"),
                size,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            })
        })
    }

    /// Maps an upload staging buffer again once the copy out of it (already
    /// submitted) is done, and keeps it for later calls. The map completes
    /// at a poll after the GPU is done, which every call makes (a queued
    /// one as it submits, a waiting one while it waits). Until then the
    /// buffer is in no pool, so no host write reaches it.
    pub fn recycle_upload_staging(&self, staging: wgpu::Buffer) {
        if staging.size() > self.upload.max_buffer_bytes {
            return;
        }
        let pool = self.upload.clone();
        let kept = staging.clone();
        staging.map_async(wgpu::MapMode::Write, .., move |mapped| {
            if mapped.is_ok() {
                pool.keep(kept);
            }
        });
    }

    /// An unmapped MAP_READ | COPY_DST buffer of at least `size` bytes: a
    /// kept one of its bucket, or a new one.
    pub fn take_readback_buffer(&self, device: &wgpu::Device, size: u64) -> wgpu::Buffer {
        self.readback.take(size, |size| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("flashport readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    }

    /// Keeps an unmapped readback buffer for later calls.
    pub fn return_readback_buffer(&self, buffer: wgpu::Buffer) {
        self.readback.keep(buffer);
    }
}

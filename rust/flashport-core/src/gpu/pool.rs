//! Host-visible buffers kept between calls: mapped staging buffers for
//! uploads (wgpu would stage every upload through a fresh host allocation,
//! whose first touch cost more than the copy) and mappable buffers for
//! readbacks (allocating and first touching a fresh host buffer of the
//! outputs' size cost more than copying out of it).

use std::sync::{Arc, Mutex};

use super::context::{lock, Context};

/// Host-visible buffers kept between calls for reuse, within bounds on
/// their count, the largest one kept and the bytes held in all: bounds the
/// host memory a finished call leaves behind.
#[derive(Clone)]
pub(crate) struct BufferPool {
    buffers: Arc<Mutex<Vec<wgpu::Buffer>>>,
    max_buffers: usize,
    pub max_buffer_bytes: u64,
    max_total_bytes: u64,
}

impl BufferPool {
    pub fn new(max_buffers: usize, max_buffer_bytes: u64, max_total_bytes: u64) -> Self {
        BufferPool {
            buffers: Default::default(),
            max_buffers,
            max_buffer_bytes,
            max_total_bytes,
        }
    }

    /// The smallest kept buffer of at least `size` bytes, or `create(size)`.
    fn take(&self, size: u64, create: impl FnOnce(u64) -> wgpu::Buffer) -> wgpu::Buffer {
        let mut pool = lock(&self.buffers);
        let best = (0..pool.len())
            .filter(|&i| pool[i].size() >= size)
            .min_by_key(|&i| pool[i].size());
        match best {
            Some(i) => pool.swap_remove(i),
            None => create(size),
        }
    }

    /// Keeps `buffer`, dropping the smallest kept ones while over bounds.
    fn keep(&self, buffer: wgpu::Buffer) {
        if buffer.size() > self.max_buffer_bytes {
            return;
        }
        let mut pool = lock(&self.buffers);
        pool.push(buffer);
        while pool.len() > self.max_buffers
            || pool.iter().map(wgpu::Buffer::size).sum::<u64>() > self.max_total_bytes
        {
            match (0..pool.len()).min_by_key(|&i| pool[i].size()) {
                Some(i) => drop(pool.swap_remove(i)),
                None => break,
            }
        }
    }
}

impl Context {
    /// A mapped MAP_WRITE | COPY_SRC buffer of at least `size` bytes: the
    /// smallest kept one that fits, or a new one.
    pub fn take_upload_staging(&self, size: u64) -> wgpu::Buffer {
        self.upload_pool.take(size, |size| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("flashport upload"),
                size,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            })
        })
    }

    /// Maps an upload staging buffer again once the copy out of it (already
    /// submitted) is done, and keeps it for later calls. The map completes
    /// at the next poll, which every call makes while waiting for its
    /// results.
    pub fn recycle_upload_staging(&self, staging: wgpu::Buffer) {
        if staging.size() > self.upload_pool.max_buffer_bytes {
            return;
        }
        let pool = self.upload_pool.clone();
        let kept = staging.clone();
        staging.map_async(wgpu::MapMode::Write, .., move |mapped| {
            if mapped.is_ok() {
                pool.keep(kept);
            }
        });
    }

    /// An unmapped MAP_READ | COPY_DST buffer of at least `size` bytes:
    /// the smallest kept one that fits, or a new one.
    pub fn take_readback_buffer(&self, size: u64) -> wgpu::Buffer {
        self.readback_pool.take(size, |size| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("flashport readback"),
                size,
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        })
    }

    /// Keeps an unmapped readback buffer for later calls.
    pub fn return_readback_buffer(&self, buffer: wgpu::Buffer) {
        self.readback_pool.keep(buffer);
    }
}

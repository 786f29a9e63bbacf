//! How much memory a GPU's driver can give buffers at most: the sum of
//! its memory heaps, as the Vulkan driver reports them.
//!
//! Why: a size check that waits for the driver to refuse an allocation
//! does not stop a KV cache of absurd size. Its pools are made buffer by
//! buffer (`kv_pool.rs`), and a driver whose device memory is host memory
//! (lavapipe, integrated GPUs) hands them out lazily, so the construction
//! ran for minutes building terabytes of buffers. wgpu reports no memory
//! size, so this asks Vulkan through wgpu's HAL; on other backends nothing
//! is known and the allocations are the check, as before. Every heap
//! counts, not only the device-local ones: an integrated GPU's
//! device-local heap can be a small carve-out beside the system memory it
//! also uses, and this bound is only to refuse what no heap could hold.

/// The bytes of all of `adapter`'s memory heaps (`None` off Vulkan, or
/// where the driver lists none).
pub(crate) fn device_memory(adapter: &wgpu::Adapter) -> Option<u64> {
    // SAFETY: the HAL adapter is only read (its instance and physical
    // device handles, for one query of memory properties) while `adapter`
    // is alive; nothing here creates or destroys Vulkan objects.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
        let instance = hal.shared_instance().raw_instance();
        let properties = instance.get_physical_device_memory_properties(hal.raw_physical_device());
        heaps_total(&properties)
    }
}

fn heaps_total(properties: &ash::vk::PhysicalDeviceMemoryProperties) -> Option<u64> {
    let heaps = properties.memory_heaps_as_slice();
    (!heaps.is_empty()).then(|| {
        heaps
            .iter()
            .map(|heap| heap.size)
            .fold(0, u64::saturating_add)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ash::vk;

    #[test]
    fn every_heap_counts() {
        let mut properties = vk::PhysicalDeviceMemoryProperties {
            memory_heap_count: 3,
            ..Default::default()
        };
        properties.memory_heaps[0] = vk::MemoryHeap {
            size: 80 << 30,
            flags: vk::MemoryHeapFlags::DEVICE_LOCAL,
        };
        properties.memory_heaps[1] = vk::MemoryHeap {
            size: 512 << 30,
            flags: vk::MemoryHeapFlags::empty(),
        };
        properties.memory_heaps[2] = vk::MemoryHeap {
            size: 256 << 20,
            flags: vk::MemoryHeapFlags::DEVICE_LOCAL,
        };
        assert_eq!(
            heaps_total(&properties),
            Some((80 << 30) + (512 << 30) + (256 << 20))
        );
        properties.memory_heap_count = 0;
        assert_eq!(heaps_total(&properties), None);
    }
}

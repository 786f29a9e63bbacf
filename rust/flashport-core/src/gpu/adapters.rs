//! The GPUs by index: which adapter is `gpu:N`, and how a call names one
//! ([`Gpu`]). Pure (adapter infos in, an order out), tested on made-up
//! adapters without a GPU; `context.rs` enumerates the real ones through it.
//!
//! The order must be the same in every process on one machine, so that a
//! Dask worker told `gpu:1` opens the card its neighbour did not: driver
//! enumeration order is not promised to be stable (Vulkan loaders order
//! ICDs by file name, NVIDIA's by its own rules), so the adapters are
//! sorted by what identifies them rather than kept as enumerated.
//!
//! - Best first, as flashport always chose: discrete, integrated, virtual,
//!   other, then software rasterisers (lavapipe, WARP) last.
//! - Within a kind, by PCI bus address (`domain:bus:device.function`, which
//!   wgpu-hal reports zero-padded in hex for Vulkan and DX12, so the text
//!   sorts as the numbers do): the order `nvidia-smi` and
//!   `CUDA_DEVICE_ORDER=PCI_BUS_ID` give. Adapters with an address come
//!   before those without.
//! - Without one (Metal, software adapters): by name, then vendor and
//!   device id, then backend, then the enumeration order as the last resort.
//! - One card seen through two backends (Vulkan and DX12 on Windows) is
//!   one GPU, kept once, through the backend flashport prefers (Vulkan,
//!   then Metal, then DX12): the same PCI address, or for adapters without
//!   one the same vendor, device id and name (the k-th such adapter of one
//!   backend matching the k-th of another).

use std::collections::HashMap;

/// A GPU as a call names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gpu {
    /// `"gpu"`: the first adapter of the order that opens (`gpu:0` unless
    /// its driver refuses a device, as flashport has always chosen), or
    /// the GPU of the call's device arrays.
    Best,
    /// `"gpu:N"`: adapter `N` of the order, and no other.
    Index(usize),
}

impl std::fmt::Display for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Gpu::Best => f.write_str("gpu"),
            Gpu::Index(n) => f.write_str(&name(*n)),
        }
    }
}

/// The device name of adapter `index`: what `device=` takes and what a
/// device array's `device` says.
pub fn name(index: usize) -> String {
    format!("gpu:{index}")
}

/// Lower is better: a hardware GPU beats a software rasteriser.
pub(crate) fn rank(kind: wgpu::DeviceType) -> u8 {
    match kind {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// Lower is preferred when one card shows through several backends:
/// Vulkan has the cooperative-matrix kernels, DX12 none of them.
fn backend_rank(backend: wgpu::Backend) -> u8 {
    match backend {
        wgpu::Backend::Vulkan => 0,
        wgpu::Backend::Metal => 1,
        wgpu::Backend::Dx12 => 2,
        _ => 3,
    }
}

/// What makes two adapters of different backends one card.
#[derive(PartialEq, Eq, Hash)]
enum Card {
    Pci(String),
    /// vendor, device id, name, and the how-manieth such adapter of its
    /// backend it is.
    Ids(u32, u32, String, usize),
}

/// The enumeration indices of `infos` in flashport's order, each card
/// once: position `N` of the result is `gpu:N`.
pub(crate) fn order(infos: &[wgpu::AdapterInfo]) -> Vec<usize> {
    let mut seen: HashMap<(wgpu::Backend, u32, u32, &str), usize> = HashMap::new();
    let cards: Vec<Card> = infos
        .iter()
        .map(|a| {
            if a.device_pci_bus_id.is_empty() {
                let count = seen
                    .entry((a.backend, a.vendor, a.device, a.name.as_str()))
                    .or_default();
                *count += 1;
                Card::Ids(a.vendor, a.device, a.name.clone(), *count)
            } else {
                Card::Pci(a.device_pci_bus_id.to_ascii_lowercase())
            }
        })
        .collect();
    // Of each card, the adapter of the preferred backend (the first
    // enumerated among equals).
    let mut kept: HashMap<&Card, usize> = HashMap::new();
    for (i, card) in cards.iter().enumerate() {
        let better = |j: &usize| backend_rank(infos[i].backend) < backend_rank(infos[*j].backend);
        match kept.get(card) {
            Some(j) if !better(j) => {}
            _ => {
                kept.insert(card, i);
            }
        }
    }
    let mut indices: Vec<usize> = kept.into_values().collect();
    indices.sort_by_key(|&i| {
        let a = &infos[i];
        (
            rank(a.device_type),
            a.device_pci_bus_id.is_empty(),
            a.device_pci_bus_id.to_ascii_lowercase(),
            a.name.clone(),
            a.vendor,
            a.device,
            backend_rank(a.backend),
            i,
        )
    });
    indices
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpu::{AdapterInfo, Backend, DeviceType};

    fn adapter(name: &str, kind: DeviceType, backend: Backend, pci: &str) -> AdapterInfo {
        AdapterInfo {
            name: name.to_string(),
            vendor: 0x10de,
            device: 0x2330,
            device_pci_bus_id: pci.to_string(),
            ..AdapterInfo::new(kind, backend)
        }
    }

    fn names(infos: &[AdapterInfo]) -> Vec<String> {
        order(infos)
            .into_iter()
            .map(|i| format!("{} {}", infos[i].name, infos[i].device_pci_bus_id))
            .collect()
    }

    #[test]
    fn by_kind_then_pci_address_whatever_the_enumeration_order() {
        let h100 = |pci| adapter("NVIDIA H100", DeviceType::DiscreteGpu, Backend::Vulkan, pci);
        let igpu = adapter(
            "Intel UHD",
            DeviceType::IntegratedGpu,
            Backend::Vulkan,
            "0000:00:02.0",
        );
        let lavapipe = adapter("llvmpipe", DeviceType::Cpu, Backend::Vulkan, "");
        let want = [
            "NVIDIA H100 0000:18:00.0",
            "NVIDIA H100 0000:2a:00.0",
            "NVIDIA H100 0000:3a:00.0",
            "NVIDIA H100 0001:04:00.0",
            "Intel UHD 0000:00:02.0",
            "llvmpipe ",
        ];
        let listed = [
            lavapipe,
            h100("0000:3a:00.0"),
            igpu,
            h100("0001:04:00.0"),
            h100("0000:18:00.0"),
            h100("0000:2a:00.0"),
        ];
        // Every rotation and the reversal of the enumeration: one order.
        for r in 0..listed.len() {
            let mut infos = listed.to_vec();
            infos.rotate_left(r);
            assert_eq!(names(&infos), want, "rotated by {r}");
            infos.reverse();
            assert_eq!(names(&infos), want, "reversed, rotated by {r}");
        }
    }

    #[test]
    fn hex_addresses_sort_as_numbers_and_case_does_not_matter() {
        let gpu = |pci| adapter("GPU", DeviceType::DiscreteGpu, Backend::Vulkan, pci);
        let infos = [
            gpu("0000:C1:00.0"),
            gpu("0000:0a:00.0"),
            gpu("0000:81:00.0"),
        ];
        assert_eq!(
            names(&infos),
            ["GPU 0000:0a:00.0", "GPU 0000:81:00.0", "GPU 0000:C1:00.0"]
        );
    }

    #[test]
    fn without_an_address_by_name_ids_then_enumeration() {
        let mut a = adapter("Apple M2", DeviceType::IntegratedGpu, Backend::Metal, "");
        let b = adapter("Apple M1", DeviceType::IntegratedGpu, Backend::Metal, "");
        let with_pci = adapter(
            "Zed",
            DeviceType::IntegratedGpu,
            Backend::Vulkan,
            "0000:05:00.0",
        );
        a.device = 1;
        let mut twin = a.clone();
        twin.driver = "second".to_string();
        let infos = [twin.clone(), a.clone(), b.clone(), with_pci];
        let order = order(&infos);
        // The addressed one first, then by name; the twins (same name and
        // ids) in enumeration order, both kept: two cards.
        assert_eq!(order, [3, 2, 0, 1]);
    }

    #[test]
    fn one_card_through_two_backends_is_one_gpu_through_vulkan() {
        let vk = adapter(
            "RTX 4090",
            DeviceType::DiscreteGpu,
            Backend::Vulkan,
            "0000:01:00.0",
        );
        let dx = adapter(
            "RTX 4090",
            DeviceType::DiscreteGpu,
            Backend::Dx12,
            "0000:01:00.0",
        );
        let vk2 = adapter(
            "RTX 4090",
            DeviceType::DiscreteGpu,
            Backend::Vulkan,
            "0000:02:00.0",
        );
        let dx2 = adapter(
            "RTX 4090",
            DeviceType::DiscreteGpu,
            Backend::Dx12,
            "0000:02:00.0",
        );
        let warp = adapter("Microsoft Basic Render", DeviceType::Cpu, Backend::Dx12, "");
        for infos in [
            vec![
                vk.clone(),
                dx.clone(),
                vk2.clone(),
                dx2.clone(),
                warp.clone(),
            ],
            vec![
                dx2.clone(),
                warp.clone(),
                dx.clone(),
                vk2.clone(),
                vk.clone(),
            ],
        ] {
            let kept: Vec<_> = order(&infos)
                .into_iter()
                .map(|i| (infos[i].backend, infos[i].device_pci_bus_id.clone()))
                .collect();
            assert_eq!(
                kept,
                [
                    (Backend::Vulkan, "0000:01:00.0".to_string()),
                    (Backend::Vulkan, "0000:02:00.0".to_string()),
                    (Backend::Dx12, String::new()),
                ]
            );
        }
        // Without addresses: the k-th of one backend is the k-th of the
        // other, so two identical cards stay two.
        let bare = |backend| adapter("Radeon", DeviceType::DiscreteGpu, backend, "");
        let infos = [
            bare(Backend::Dx12),
            bare(Backend::Vulkan),
            bare(Backend::Dx12),
            bare(Backend::Vulkan),
        ];
        let kept: Vec<_> = order(&infos)
            .into_iter()
            .map(|i| infos[i].backend)
            .collect();
        assert_eq!(kept, [Backend::Vulkan, Backend::Vulkan]);
    }

    #[test]
    fn nothing_to_order() {
        assert!(order(&[]).is_empty());
    }

    #[test]
    fn device_names() {
        assert_eq!(Gpu::Best.to_string(), "gpu");
        assert_eq!(Gpu::Index(3).to_string(), "gpu:3");
        assert_eq!(name(0), "gpu:0");
    }
}

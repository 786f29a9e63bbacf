//! NVIDIA's cooperative matrices 2 (`VK_NV_cooperative_matrix2`): the
//! device opened with the extension where the adapter offers it, and the
//! kernels written for it (shaders/cm2/, GLSL compiled by a pinned glslang
//! into the SPIR-V checked in beside them, `scripts/cm2.sh`).
//!
//! Why: the portable cooperative matrices (`VK_KHR_cooperative_matrix`, and
//! WGSL's, which exposes only load, store and multiply-add) have no row
//! reduction, no per-element function and no conversion of an accumulator
//! to an operand, so the cooperative kernels pass every score tile through
//! workgroup memory and scalar code. The NV extension has all three, and
//! ggml's Vulkan flash attention built on it reaches 165 TFLOP/s on the
//! H100 where the portable kernels reach 72 (`../shared/research/
//! gpu-survey-2026-11.md`).
//!
//! wgpu 30 does not know the extension: the device is opened through
//! wgpu-hal with the extension's name and feature structure added
//! (`Adapter::open_with_callback`), only where the adapter lists both
//! (wgpu-hal panics on an extension the driver lacks), and the kernels go
//! to the driver as passthrough modules with their specialisation
//! constants set in the words (wgpu passes none to such a module).

use std::ffi::{c_void, CStr};
use std::marker::PhantomData;

use ash::vk;
use wgpu::hal;

use super::kernel::{Kernel, Pass, Tier};

const EXTENSION: &CStr = c"VK_NV_cooperative_matrix2";

/// `VkPhysicalDeviceCooperativeMatrix2FeaturesNV` (ash 0.38 predates it).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Cm2Features<'a> {
    s_type: vk::StructureType,
    p_next: *mut c_void,
    workgroup_scope: vk::Bool32,
    flexible_dimensions: vk::Bool32,
    reductions: vk::Bool32,
    conversions: vk::Bool32,
    per_element_operations: vk::Bool32,
    tensor_addressing: vk::Bool32,
    block_loads: vk::Bool32,
    _marker: PhantomData<&'a ()>,
}

const FEATURES_TYPE: vk::StructureType = vk::StructureType::from_raw(1_000_593_000);

impl Default for Cm2Features<'_> {
    fn default() -> Self {
        Cm2Features {
            s_type: FEATURES_TYPE,
            p_next: std::ptr::null_mut(),
            workgroup_scope: vk::FALSE,
            flexible_dimensions: vk::FALSE,
            reductions: vk::FALSE,
            conversions: vk::FALSE,
            per_element_operations: vk::FALSE,
            tensor_addressing: vk::FALSE,
            block_loads: vk::FALSE,
            _marker: PhantomData,
        }
    }
}

// SAFETY: the layout of the Vulkan structure (sType and pNext first), which
// the specification allows in both chains.
unsafe impl vk::TaggedStructure for Cm2Features<'_> {
    const STRUCTURE_TYPE: vk::StructureType = FEATURES_TYPE;
}
unsafe impl vk::ExtendsPhysicalDeviceFeatures2 for Cm2Features<'_> {}
unsafe impl vk::ExtendsDeviceCreateInfo for Cm2Features<'_> {}

/// Whether `adapter` (Vulkan 1.3) lists the extension with every feature
/// the kernels use.
pub(crate) fn offered(adapter: &wgpu::Adapter) -> bool {
    // SAFETY: read-only queries of the adapter's own physical device.
    unsafe {
        let Some(hal_adapter) = adapter.as_hal::<hal::api::Vulkan>() else {
            return false;
        };
        let caps = hal_adapter.physical_device_capabilities();
        if caps.properties().api_version < vk::API_VERSION_1_3
            || !caps.supports_extension(EXTENSION)
        {
            return false;
        }
        let instance = hal_adapter.shared_instance().raw_instance();
        let mut cm2 = Cm2Features::default();
        let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut cm2);
        instance.get_physical_device_features2(hal_adapter.raw_physical_device(), &mut features);
        [
            cm2.workgroup_scope,
            cm2.flexible_dimensions,
            cm2.reductions,
            cm2.conversions,
            cm2.per_element_operations,
            cm2.tensor_addressing,
        ]
        .iter()
        .all(|&on| on == vk::TRUE)
    }
}

/// Opens `adapter` as `request_device` would with `desc`, the extension
/// and its features added (the caller checked [`offered`]).
pub(crate) fn open(
    adapter: &wgpu::Adapter,
    desc: &wgpu::DeviceDescriptor<'_>,
) -> Result<(wgpu::Device, wgpu::Queue), String> {
    let mut enable = Cm2Features {
        workgroup_scope: vk::TRUE,
        flexible_dimensions: vk::TRUE,
        reductions: vk::TRUE,
        conversions: vk::TRUE,
        per_element_operations: vk::TRUE,
        tensor_addressing: vk::TRUE,
        ..Default::default()
    };
    let opened = {
        // SAFETY: the guard lives for this block; the callback adds an
        // extension the adapter lists and a structure of features it
        // reports, and chains nothing wgpu chains itself (the KHR
        // cooperative matrices, the Vulkan memory model and float16 come
        // with `desc`'s features).
        let hal_adapter = unsafe { adapter.as_hal::<hal::api::Vulkan>() }
            .ok_or_else(|| "not a Vulkan adapter".to_string())?;
        let enable = &mut enable;
        let callback: Box<hal::vulkan::CreateDeviceCallback<'_>> = Box::new(move |args| {
            args.extensions.push(EXTENSION);
            *args.create_info = args.create_info.push_next(enable);
        });
        unsafe {
            hal_adapter.open_with_callback(
                desc.required_features,
                &desc.required_limits,
                &desc.memory_hints,
                Some(callback),
            )
        }
        .map_err(|e| format!("opening the device with {EXTENSION:?}: {e}"))?
    };
    // SAFETY: `opened` is this adapter's, with `desc`'s features and limits,
    // which the caller took from what the adapter offers.
    unsafe { adapter.create_device_from_hal(opened, desc) }.map_err(|e| e.to_string())
}

/// The kernels (shaders/cm2/*.comp) as glslang wrote them.
const FORWARD: &[u8] = include_bytes!("../../../../shaders/cm2/forward.spv");
const BACKWARD_DQ: &[u8] = include_bytes!("../../../../shaders/cm2/backward_dq.spv");
const BACKWARD_DKDV: &[u8] = include_bytes!("../../../../shaders/cm2/backward_dkdv.spv");

/// The kernels' specialisation constants, by the shaders' `constant_id`
/// (shaders/cm2/common.glsl).
pub(crate) const SPEC_D: u32 = 0;
pub(crate) const SPEC_DV: u32 = 1;
pub(crate) const SPEC_BR: u32 = 2;
pub(crate) const SPEC_BC: u32 = 3;
/// The clamp mode of the q, k, v and o tensor layouts: 1
/// (`gl_CooperativeMatrixClampModeConstantNV`: zeros read past the edges,
/// nothing written there) by default, 0 (undefined) where the problem is
/// whole tiles and nothing lies past them.
pub(crate) const SPEC_CLAMP: u32 = 4;
/// The variants the kernels take, 0 or 1: the softcap, the left window,
/// ALiBi, a mask and sinks.
pub(crate) const SPEC_SOFTCAP: u32 = 5;
pub(crate) const SPEC_WINDOW: u32 = 6;
pub(crate) const SPEC_ALIBI: u32 = 7;
pub(crate) const SPEC_MASK: u32 = 8;
pub(crate) const SPEC_SINKS: u32 = 9;

/// The words of `kernel` (a cooperative-matrix-2 one) with its constants
/// set to `values` (id, value).
pub(crate) fn kernel_words(kernel: Kernel, values: &[(u32, u32)]) -> Result<Vec<u32>, String> {
    let spv = match (kernel.pass(), kernel.tier()) {
        (Pass::Forward, Tier::Cm2) => FORWARD,
        (Pass::BackwardDq, Tier::Cm2) => BACKWARD_DQ,
        (Pass::BackwardDkDv, Tier::Cm2) => BACKWARD_DKDV,
        _ => {
            return Err(format!(
                "{} has no cooperative-matrix-2 SPIR-V",
                kernel.name()
            ))
        }
    };
    let words: Vec<u32> = spv
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    specialised(words, values)
}

const MAGIC: u32 = 0x0723_0203;
const OP_DECORATE: u32 = 71;
const OP_SPEC_CONSTANT: u32 = 50;
const DECORATION_SPEC_ID: u32 = 1;

/// `words` with the default value of each specialisation constant in
/// `values` (id, value) set to its value: what `VkSpecializationInfo`
/// would do, for a driver given no such info. Every id must be declared,
/// as a 32-bit `OpSpecConstant`.
pub(crate) fn specialised(mut words: Vec<u32>, values: &[(u32, u32)]) -> Result<Vec<u32>, String> {
    if words.len() < 5 || words[0] != MAGIC {
        return Err("not a SPIR-V module".to_string());
    }
    let instructions = |words: &[u32]| {
        let mut at = 5;
        let mut out = Vec::new();
        while at < words.len() {
            let count = (words[at] >> 16) as usize;
            if count == 0 || at + count > words.len() {
                return Err(format!("a malformed instruction at word {at}"));
            }
            out.push((at, words[at] & 0xffff, count));
            at += count;
        }
        Ok(out)
    };
    let list = instructions(&words)?;
    // Result id → spec id.
    let mut ids = std::collections::HashMap::new();
    for &(at, op, count) in &list {
        if op == OP_DECORATE && count == 4 && words[at + 2] == DECORATION_SPEC_ID {
            ids.insert(words[at + 1], words[at + 3]);
        }
    }
    let mut set = vec![false; values.len()];
    for &(at, op, count) in &list {
        if op != OP_SPEC_CONSTANT {
            continue;
        }
        let Some(&spec) = ids.get(&words[at + 2]) else {
            continue;
        };
        if let Some(i) = values.iter().position(|&(id, _)| id == spec) {
            if count != 4 {
                return Err(format!(
                    "specialisation constant {spec} is not 32 bits wide"
                ));
            }
            words[at + 3] = values[i].1;
            set[i] = true;
        }
    }
    match values.iter().zip(&set).find(|(_, &done)| !done) {
        Some(((id, _), _)) => Err(format!("no specialisation constant {id} in the module")),
        None => Ok(words),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The default of constant `spec` in `words`.
    fn default_of(words: &[u32], spec: u32) -> Option<u32> {
        let mut at = 5;
        let mut target = None;
        let mut found = None;
        while at < words.len() {
            let (count, op) = ((words[at] >> 16) as usize, words[at] & 0xffff);
            if op == OP_DECORATE
                && count == 4
                && words[at + 2] == DECORATION_SPEC_ID
                && words[at + 3] == spec
            {
                target = Some(words[at + 1]);
            }
            if op == OP_SPEC_CONSTANT && Some(words[at + 2]) == target {
                found = Some(words[at + 3]);
            }
            at += count;
        }
        found
    }

    fn forward_words(values: &[(u32, u32)]) -> Result<Vec<u32>, String> {
        kernel_words(Kernel::forward(Tier::Cm2), values)
    }

    #[test]
    fn every_kernel_declares_every_constant() {
        for kernel in [
            Kernel::forward(Tier::Cm2),
            Kernel::dq(Tier::Cm2),
            Kernel::dkdv(Tier::Cm2),
        ] {
            let words = kernel_words(kernel, &[]).unwrap();
            for spec in [SPEC_D, SPEC_DV, SPEC_BR, SPEC_BC, SPEC_CLAMP] {
                assert!(default_of(&words, spec).is_some(), "{kernel:?} {spec}");
            }
        }
        assert!(kernel_words(Kernel::forward(Tier::Coop), &[]).is_err());
    }

    #[test]
    fn the_forward_is_specialised_constant_by_constant() {
        let words = forward_words(&[]).unwrap();
        // The shader's defaults.
        for spec in [SPEC_D, SPEC_DV, SPEC_BR, SPEC_BC] {
            assert_eq!(default_of(&words, spec), Some(64), "constant {spec}");
        }
        assert_eq!(default_of(&words, SPEC_CLAMP), Some(1));
        let set = forward_words(&[(SPEC_D, 128), (SPEC_DV, 80), (SPEC_BR, 32)]).unwrap();
        assert_eq!(default_of(&set, SPEC_D), Some(128));
        assert_eq!(default_of(&set, SPEC_DV), Some(80));
        assert_eq!(default_of(&set, SPEC_BR), Some(32));
        assert_eq!(default_of(&set, SPEC_BC), Some(64));
        // Nothing else changed.
        let changed = words.iter().zip(&set).filter(|(a, b)| a != b).count();
        assert_eq!(changed, 3);
        assert!(forward_words(&[(10, 1)])
            .unwrap_err()
            .contains("no specialisation constant 10"));
        assert!(specialised(vec![1, 2, 3], &[]).is_err());
    }

    /// The Vulkan bindings a module declares.
    fn bindings_of(words: &[u32]) -> Vec<u32> {
        const DECORATION_BINDING: u32 = 33;
        let mut at = 5;
        let mut out = Vec::new();
        while at < words.len() {
            let count = (words[at] >> 16) as usize;
            if words[at] & 0xffff == OP_DECORATE
                && count == 4
                && words[at + 2] == DECORATION_BINDING
            {
                out.push(words[at + 3]);
            }
            at += count;
        }
        out.sort_unstable();
        out
    }

    /// The variants' array sits where wgpu-hal puts wgpu's binding 15 in
    /// the layout gpu/pipelines.rs builds (its entries numbered in order:
    /// the uniform, the reads, two writes, then 15), and every other
    /// binding below it.
    #[test]
    fn the_variants_binding_follows_the_layout_s_other_entries() {
        use crate::gpu::kernel::Tier;
        for (kernel, entries) in [
            (Kernel::forward(Tier::Cm2), 1 + 3 + 2),
            (Kernel::dq(Tier::Cm2), 1 + 5 + 2),
            (Kernel::dkdv(Tier::Cm2), 1 + 5 + 2),
        ] {
            let words = kernel_words(kernel, &[]).unwrap();
            let bindings = bindings_of(&words);
            assert_eq!(bindings.last(), Some(&entries), "{}", kernel.name());
            assert!(
                bindings[..bindings.len() - 1].iter().all(|&b| b < entries),
                "{}: {bindings:?}",
                kernel.name()
            );
        }
    }
}

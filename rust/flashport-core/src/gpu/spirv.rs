//! SPIR-V for the cooperative-matrix kernels, written by naga here and
//! given to the driver through wgpu's passthrough, with two changes: the
//! module declares the GLSL450 memory model instead of the Vulkan one, and
//! its subgroup barriers order workgroup memory
//! (`subgroup_barriers_order_workgroup_memory` says why).
//!
//! The memory model:
//! Why: naga 30 declares `OpMemoryModel Logical Vulkan` (and the
//! VulkanMemoryModel capability) as soon as a module uses a cooperative
//! matrix type, but keeps writing the rest of the module for the GLSL450
//! model: its loads and stores carry no `NonPrivatePointer` operand and its
//! `workgroupBarrier` is `OpControlBarrier` with AcquireRelease |
//! WorkgroupMemory only, without MakeAvailable | MakeVisible. Under the
//! Vulkan memory model those are private accesses that no barrier orders
//! between invocations, so a kernel that passes data through workgroup
//! memory has data races by the letter of the model (wgpu issue
//! gfx-rs/wgpu#8805; fix proposed in gfx-rs/wgpu#10016). Under GLSL450,
//! which every other kernel here is compiled for, workgroup memory is
//! coherent and the same barrier orders it. Cooperative matrices do not
//! need the Vulkan memory model (GLSL's GL_KHR_cooperative_matrix shaders
//! are compiled for GLSL450). On the H100 (driver 580) both modules gave
//! the same results, right and wrong alike: the wrong results of the first
//! cooperative forward had another cause (shaders/coop/forward.wgsl); this
//! keeps the module within the spec rather than relying on the driver.
//!
//! What this module does: parse and validate the WGSL, apply the pipeline's
//! override values (passthrough modules take none), write SPIR-V with the
//! bounds-check policy wgpu would use, switch the memory model, make the
//! subgroup barriers order workgroup memory (see
//! `subgroup_barriers_order_workgroup_memory`), and list
//! the bindings for the explicit pipeline layout (passthrough modules have
//! no reflection for an automatic one).

use wgpu::naga;

/// One kernel as SPIR-V words, with what the host needs to build its
/// pipeline.
pub struct Compiled {
    pub words: Vec<u32>,
    /// Every resource binding of group 0 the module declares.
    pub bindings: Vec<wgpu::BindGroupLayoutEntry>,
    pub workgroup_size: [u32; 3],
}

const OP_EXTENSION: u32 = 10;
const OP_MEMORY_MODEL: u32 = 14;
const OP_CAPABILITY: u32 = 17;
const CAPABILITY_VULKAN_MEMORY_MODEL: u32 = 5345;
const MEMORY_MODEL_GLSL450: u32 = 1;
const MEMORY_MODEL_VULKAN: u32 = 3;
const VULKAN_MEMORY_MODEL_EXTENSION: &str = "SPV_KHR_vulkan_memory_model";

/// The string operand starting at `words[0]` (nul-terminated, packed four
/// bytes a word, little end first).
fn literal_string(words: &[u32]) -> String {
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// `words` with the Vulkan memory model replaced by GLSL450: the
/// `OpMemoryModel` operand changed, the VulkanMemoryModel capability and
/// the SPV_KHR_vulkan_memory_model extension dropped. Returns the module
/// unchanged (and false) where it does not declare the Vulkan model.
pub fn glsl450_memory_model(words: &[u32]) -> (Vec<u32>, bool) {
    if words.len() < 5 {
        return (words.to_vec(), false);
    }
    let mut out = words[..5].to_vec();
    let mut changed = false;
    let mut at = 5;
    while at < words.len() {
        let count = (words[at] >> 16) as usize;
        let op = words[at] & 0xffff;
        if count == 0 || at + count > words.len() {
            // Malformed: leave the rest as it is.
            out.extend_from_slice(&words[at..]);
            break;
        }
        let inst = &words[at..at + count];
        let drop = match op {
            OP_CAPABILITY => count == 2 && inst[1] == CAPABILITY_VULKAN_MEMORY_MODEL,
            OP_EXTENSION => literal_string(&inst[1..]) == VULKAN_MEMORY_MODEL_EXTENSION,
            _ => false,
        };
        if !drop {
            let start = out.len();
            out.extend_from_slice(inst);
            if op == OP_MEMORY_MODEL && count == 3 && inst[2] == MEMORY_MODEL_VULKAN {
                out[start + 2] = MEMORY_MODEL_GLSL450;
                changed = true;
            }
        }
        at += count;
    }
    if changed {
        (out, true)
    } else {
        (words.to_vec(), false)
    }
}

const OP_TYPE_INT: u32 = 21;
const OP_CONSTANT: u32 = 43;
const OP_CONTROL_BARRIER: u32 = 224;
const SCOPE_SUBGROUP: u32 = 3;
/// AcquireRelease | WorkgroupMemory: what `workgroupBarrier()` carries.
pub const SEMANTICS_WORKGROUP_MEMORY: u32 = 0x8 | 0x100;

/// The instructions of `words` after the header, each with its offset;
/// stops at the first malformed one.
fn instructions(words: &[u32]) -> impl Iterator<Item = (usize, &[u32])> {
    let mut at = 5;
    std::iter::from_fn(move || {
        let count = (*words.get(at)? >> 16) as usize;
        if count == 0 || at + count > words.len() {
            return None;
        }
        let start = at;
        at += count;
        Some((start, &words[start..start + count]))
    })
}

/// The id of the 32-bit unsigned integer type, and the offset right after
/// its declaration.
fn u32_type(words: &[u32]) -> Option<(u32, usize)> {
    instructions(words)
        .find(|(_, i)| i[0] & 0xffff == OP_TYPE_INT && i.len() == 4 && i[2] == 32 && i[3] == 0)
        .map(|(at, i)| (i[1], at + i.len()))
}

/// The id of the u32 constant `value` of type `ty`, if declared.
fn u32_constant(words: &[u32], ty: u32, value: u32) -> Option<u32> {
    instructions(words)
        .find(|(_, i)| i[0] & 0xffff == OP_CONSTANT && i.len() == 4 && i[1] == ty && i[3] == value)
        .map(|(_, i)| i[2])
}

/// The memory-semantics value of every subgroup-scope `OpControlBarrier`
/// (WGSL's `subgroupBarrier()`), in module order.
#[cfg(any(test, feature = "testing"))]
pub fn subgroup_barrier_semantics(words: &[u32]) -> Vec<u32> {
    let Some((ty, _)) = u32_type(words) else {
        return Vec::new();
    };
    let Some(subgroup) = u32_constant(words, ty, SCOPE_SUBGROUP) else {
        return Vec::new();
    };
    let value = |id: u32| {
        instructions(words)
            .find(|(_, i)| i[0] & 0xffff == OP_CONSTANT && i.len() == 4 && i[2] == id)
            .map_or(u32::MAX, |(_, i)| i[3])
    };
    instructions(words)
        .filter(|(_, i)| i[0] & 0xffff == OP_CONTROL_BARRIER && i.len() == 4 && i[1] == subgroup)
        .map(|(_, i)| value(i[3]))
        .collect()
}

/// `words` with every subgroup-scope `OpControlBarrier` given
/// AcquireRelease | WorkgroupMemory semantics, and how many there were.
///
/// Why: naga writes WGSL's `subgroupBarrier()` with SubgroupMemory
/// semantics, a storage class that the Vulkan environment ignores, so by
/// the letter such a barrier orders no memory at all. The cooperative
/// backward kernels pass each subgroup's scores and weights through its own
/// rows of workgroup memory behind subgroup barriers
/// (lib/coop.wgsl, SUBGROUP_SCRATCH), which is what
/// GLSL's `subgroupMemoryBarrierShared(); subgroupBarrier();` expresses.
pub fn subgroup_barriers_order_workgroup_memory(words: &[u32]) -> (Vec<u32>, usize) {
    let Some((ty, after_type)) = u32_type(words) else {
        return (words.to_vec(), 0);
    };
    let Some(subgroup) = u32_constant(words, ty, SCOPE_SUBGROUP) else {
        return (words.to_vec(), 0);
    };
    let barriers: Vec<usize> = instructions(words)
        .filter(|(_, i)| i[0] & 0xffff == OP_CONTROL_BARRIER && i.len() == 4 && i[1] == subgroup)
        .map(|(at, _)| at)
        .collect();
    if barriers.is_empty() {
        return (words.to_vec(), 0);
    }
    let mut out = words.to_vec();
    let semantics = match u32_constant(words, ty, SEMANTICS_WORKGROUP_MEMORY) {
        Some(id) => id,
        None => {
            // A new constant right after the u32 type; its id is the
            // module's bound, which grows by one. The barriers come after
            // the declarations, so their offsets move by the 4 words.
            let id = out[3];
            out[3] += 1;
            let decl = [(4 << 16) | OP_CONSTANT, ty, id, SEMANTICS_WORKGROUP_MEMORY];
            out.splice(after_type..after_type, decl);
            for &at in &barriers {
                out[at + 4 + 3] = id;
            }
            return (out, barriers.len());
        }
    };
    for &at in &barriers {
        out[at + 3] = semantics;
    }
    (out, barriers.len())
}

/// The memory model a module declares (1 GLSL450, 3 Vulkan), if any.
#[cfg(any(test, feature = "testing"))]
pub fn memory_model(words: &[u32]) -> Option<u32> {
    let mut at = 5;
    while at < words.len() {
        let count = (words[at] >> 16) as usize;
        if count == 0 {
            return None;
        }
        if words[at] & 0xffff == OP_MEMORY_MODEL && count == 3 {
            return words.get(at + 2).copied();
        }
        at += count;
    }
    None
}

/// Compiles the compute entry point `main` of `source` with `constants`
/// for the overrides. `unchecked` drops naga's index clamps and loop
/// bounds (as `ShaderRuntimeChecks::unchecked` does); `glsl450` switches
/// the memory model (see the module's comment).
pub fn compile(
    source: &str,
    constants: &[(&str, f64)],
    unchecked: bool,
    glsl450: bool,
) -> Result<Compiled, String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    let mut validator = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    );
    validator.subgroup_stages(naga::valid::ShaderStages::COMPUTE);
    validator.subgroup_operations(naga::valid::SubgroupOperationSet::all());
    let info = validator
        .validate(&module)
        .map_err(|e| e.emit_to_string(source))?;
    let values: naga::back::PipelineConstants = constants
        .iter()
        .map(|&(name, value)| (name.to_string(), value))
        .collect();
    let (module, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, "main")),
        &values,
    )
    .map_err(|e| format!("applying the overrides: {e}"))?;
    let entry = module
        .entry_points
        .iter()
        .find(|e| e.name == "main")
        .ok_or("no entry point `main`")?;
    let workgroup_size = entry.workgroup_size;
    let bindings = module
        .global_variables
        .iter()
        .filter_map(|(_, var)| {
            let binding = var.binding.as_ref()?;
            if binding.group != 0 {
                return None;
            }
            let ty = match var.space {
                naga::AddressSpace::Uniform => wgpu::BufferBindingType::Uniform,
                naga::AddressSpace::Storage { access } => wgpu::BufferBindingType::Storage {
                    read_only: !access.contains(naga::StorageAccess::STORE),
                },
                _ => return None,
            };
            Some(wgpu::BindGroupLayoutEntry {
                binding: binding.binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer {
                    ty,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                count: None,
            })
        })
        .collect();
    let policy = if unchecked {
        naga::proc::BoundsCheckPolicy::Unchecked
    } else {
        naga::proc::BoundsCheckPolicy::Restrict
    };
    let options = naga::back::spv::Options {
        lang_version: (1, 5),
        flags: naga::back::spv::WriterFlags::empty(),
        // Bindings keep their numbers: group g, binding b is descriptor set
        // g, binding b (what wgpu's Vulkan backend does for these layouts).
        fake_missing_bindings: true,
        capabilities: None,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: policy,
            buffer: policy,
            image_load: policy,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: naga::back::spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: !unchecked,
        use_storage_input_output_16: false,
        ..Default::default()
    };
    let pipeline_options = naga::back::spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: "main".to_string(),
    };
    let words = naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline_options))
        .map_err(|e| format!("writing SPIR-V: {e}"))?;
    let words = if glsl450 {
        glsl450_memory_model(&words).0
    } else {
        words
    };
    let (words, _) = subgroup_barriers_order_workgroup_memory(&words);
    Ok(Compiled {
        words,
        bindings,
        workgroup_size,
    })
}

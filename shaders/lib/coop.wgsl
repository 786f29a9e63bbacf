enable f16;
enable wgpu_cooperative_matrix;

// What the cooperative-matrix kernels (shaders/coop) share. It opens their
// modules, before lib/common.wgsl, because WGSL wants its `enable`
// directives before any declaration. The kernels need the device features
// SHADER_F16, SUBGROUP and EXPERIMENTAL_COOPERATIVE_MATRIX with a
// 16x16x16 f16 -> f32 configuration, and subgroups of exactly 32 lanes.

alias A16 = coop_mat16x16<f16, A>;
alias B16 = coop_mat16x16<f16, B>;
alias C32 = coop_mat16x16<f32, C>;

// D / 16 and DV / 16 are at most MAXN (head dimensions up to 128).
const MAXN: u32 = 8u;

// Whether a subgroup barrier orders workgroup memory, so that a subgroup
// can wait for its own lanes' writes to rows of workgroup memory only it
// reads without waiting for the others: true where the host builds the
// SPIR-V itself (src/gpu/spirv.rs makes those barriers order workgroup
// memory); false with wgpu's own SPIR-V, whose subgroup barriers do not,
// and every wait is then workgroup-wide (so the kernels keep their
// subgroups' loops in step).
override SUBGROUP_SCRATCH: bool = true;

// Waits until this subgroup's writes to its own rows of workgroup memory
// are visible to the whole subgroup (see SUBGROUP_SCRATCH).
fn scratch_barrier() {
    if SUBGROUP_SCRATCH {
        subgroupBarrier();
    } else {
        workgroupBarrier();
    }
}

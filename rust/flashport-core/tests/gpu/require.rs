//! Whether the GPU tests run: shared by the `gpu` and `gpu_lost` test
//! binaries, and read as tests/conftest.py reads it for the Python suite.

/// Whether wgpu finds an adapter. Without one, a test prints why and
/// returns (Rust tests cannot mark themselves skipped), unless
/// `FLASHPORT_REQUIRE_GPU=1` (CI, with lavapipe installed), where a
/// missing adapter is a failure: a broken driver install cannot pass as
/// "skipped".
pub fn gpu_present() -> bool {
    if !flashport_core::gpu::adapters().is_empty() {
        return true;
    }
    if std::env::var("FLASHPORT_REQUIRE_GPU").as_deref() == Ok("1") {
        panic!(
            "FLASHPORT_REQUIRE_GPU=1 but no GPU adapter found \
             (install Mesa's lavapipe: mesa-vulkan-drivers)"
        );
    }
    eprintln!(
        "SKIPPED: no GPU adapter (install Mesa's lavapipe: mesa-vulkan-drivers; \
         FLASHPORT_REQUIRE_GPU=1 makes this a failure)"
    );
    false
}

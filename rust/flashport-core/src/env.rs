//! The on/off switches flashport reads from the environment
//! (`FLASHPORT_DEVICE` and `FLASHPORT_NUM_THREADS` are parsed where they
//! are used). A value that is neither on nor off is an error naming the
//! variable, not silently off: `FLASHPORT_GPU_POISON=true` would otherwise
//! run a test suite without the poisoning it asked for.

use crate::error::{Error, Result};

/// Fills GPU outputs with NaN before the kernels run (the test suites).
pub const GPU_POISON: &str = "FLASHPORT_GPU_POISON";
/// Keeps naga's index clamps in every kernel (debugging).
pub const GPU_CHECKED: &str = "FLASHPORT_GPU_CHECKED";

/// Whether switch `name` is on: `1` is on; unset, empty or `0` is off.
pub fn switch(name: &str) -> Result<bool> {
    match std::env::var_os(name) {
        None => Ok(false),
        Some(value) => match value.to_str() {
            Some("1") => Ok(true),
            Some("" | "0") => Ok(false),
            _ => Err(Error::Value {
                argument: name.to_string(),
                value: format!("{value:?}"),
                reason: "expected 1 (on) or 0 (off)".to_string(),
            }),
        },
    }
}

/// Checks the switches of GPU calls, at the start of each.
pub(crate) fn check_gpu_switches() -> Result<()> {
    switch(GPU_POISON)?;
    switch(GPU_CHECKED)?;
    Ok(())
}

/// Whether switch `name` is on, where a call has already checked it.
pub(crate) fn switch_on(name: &str) -> bool {
    matches!(switch(name), Ok(true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switch_values() {
        // A variable no other test reads, so setting it races nothing.
        let name = "FLASHPORT_TEST_SWITCH_VALUES";
        for (value, expected) in [("1", true), ("0", false), ("", false)] {
            std::env::set_var(name, value);
            assert_eq!(switch(name), Ok(expected), "{value:?}");
        }
        for value in ["true", "yes", "2", " 1"] {
            std::env::set_var(name, value);
            match switch(name) {
                Err(Error::Value { argument, .. }) => assert_eq!(argument, name),
                other => panic!("{value:?} gave {other:?}"),
            }
        }
        std::env::remove_var(name);
        assert_eq!(switch(name), Ok(false));
    }
}

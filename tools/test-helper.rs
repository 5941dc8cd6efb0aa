//! Test helper for the process layer: one program, many behaviours, chosen by the first argument,
//! each reporting readiness on stdout so that tests synchronise on lines, never on sleeps. The
//! modes of each system are listed in its file.

#[cfg(unix)]
#[path = "test-helper-linux.rs"]
mod platform;
#[cfg(windows)]
#[path = "test-helper-windows.rs"]
mod platform;

fn main() {
    platform::main()
}

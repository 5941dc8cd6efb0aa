#[cfg(unix)]
fn main() -> std::process::ExitCode {
    nodeplan::cli::main()
}

/// On Windows the binary has one more mode, the process layer's own: raising Ctrl-C on a run's
/// console (the graceful step of the stop ladder; see `src/process/job.rs`).
#[cfg(windows)]
fn main() -> std::process::ExitCode {
    use nodeplan::process::{INTERRUPT_MODE, interrupt_console};
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [mode, pid] = args.as_slice()
        && mode == INTERRUPT_MODE
    {
        return match pid
            .parse()
            .map_err(|e| format!("{e}"))
            .and_then(|p| interrupt_console(p).map_err(|e| e.to_string()))
        {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("nodeplan: cannot interrupt the console of process {pid}: {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    nodeplan::cli::main()
}

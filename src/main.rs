#[cfg(unix)]
fn main() -> std::process::ExitCode {
    nodeplan::cli::main()
}

/// Only the process layer is built for Windows so far (issue 42; docs/windows.md). The one mode
/// here is the process layer's own: raising Ctrl-C on a run's console.
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
    eprintln!(
        "nodeplan: the agent does not run on Windows yet; only its process layer is built for it (see docs/windows.md)"
    );
    std::process::ExitCode::from(2)
}

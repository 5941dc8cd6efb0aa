fn main() -> std::process::ExitCode {
    nodeplan::cli::main()
}

//! The `burn-zero run` launcher, built inside this package so its tests can start it. Takes the
//! arguments of `burn-zero run`, with or without the `run` itself: the multi-node launcher
//! starts each node as `<this program> run ...`.

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().is_some_and(|a| a == "run") {
        args.remove(0);
    }
    match burn_zero::launch::LaunchOptions::parse(&args) {
        Ok(opts) => std::process::exit(burn_zero::launch::run(&opts)),
        Err(e) => {
            eprintln!("launcher: {e}\nusage: {}", burn_zero::launch::RUN_USAGE);
            std::process::exit(2);
        }
    }
}

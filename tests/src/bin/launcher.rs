//! The `burn-zero run` launcher, built inside this package so its tests can start it.

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match burn_zero::launch::LaunchOptions::parse(&args) {
        Ok(opts) => std::process::exit(burn_zero::launch::run(&opts)),
        Err(e) => {
            eprintln!("launcher: {e}\nusage: {}", burn_zero::launch::RUN_USAGE);
            std::process::exit(2);
        }
    }
}

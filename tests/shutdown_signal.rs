//! The stop signal on its own test binary: the handlers it installs stay
//! for the process, which then no longer stops on SIGTERM or Ctrl-C.

/// A SIGTERM between the call and the first poll is caught: before, the
/// handler was installed at the first poll, and such a signal killed the
/// process (a Baton that said it listens, stopped under load).
#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_stop_signal_is_caught_from_the_call_on() {
    use rustix::process::{Signal, getpid, kill_process};
    let stop = baton::launch::shutdown_signal();
    kill_process(getpid(), Signal::TERM).unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(5), stop)
        .await
        .expect("the signal stops it");
}

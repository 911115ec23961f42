/// glibc's malloc was a quarter of the relay's CPU flat out (`perf`: every
/// event allocates its row, headers and message, and frees them once acked,
/// often on another thread). mimalloc's thread-local free lists cost less.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    outbox_relay::cli::main()
}
